"""Small but real training jobs used by the demo, the drill, the templates and the tests."""
