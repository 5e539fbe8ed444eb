"""Small but real training jobs used by the demo, the drill, the templates and the tests."""

__all__ = ["tiny_gpt", "train"]  # its modules, imported by path
