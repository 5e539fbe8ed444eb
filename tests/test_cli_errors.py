"""Every command with an unusable state dir or run dir: exit 1 (2 for a usage error) and a
short message naming the path, never a traceback (issue 43)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_guard.cli.main import main
from slurm_guard.cli.options import default_state_dir
from slurm_guard.protocol import DEFAULT_STATE_DIR

ENV = {"SLURM_CONF": "/nonexistent/slurm.conf", "SLURM_JOB_ID": "4242"}


def _bad(tmp: Path, kind: str) -> Path:
    (tmp / "afile").write_text("x")
    (tmp / "empty").mkdir(exist_ok=True)
    return {
        "file": tmp / "afile",
        "below-file": tmp / "afile" / "below",
        "missing": tmp / "missing",
        "empty": tmp / "empty",
    }[kind]


# (command line, which of its paths is bad, kinds that must fail)
STATE = ("file", "below-file")
RUN = ("file", "below-file")
COMMANDS = [
    (["controller", "--runs-root", "{ok}", "--state-dir", "{bad}"], STATE),
    (["controller", "--runs-root", "{bad}", "--state-dir", "{ok}/st"], RUN),
    (["epilog", "--state-dir", "{bad}"], STATE),
    (["recover", "--run-dir", "{ok}", "--state-dir", "{bad}"], STATE),
    (["recover", "--run-dir", "{bad}", "--state-dir", "{ok}/st"], (*RUN, "missing")),
    (["supervise", "--nodes", "1", "--run-dir", "{bad}", "--state-dir", "{ok}/st", "true"], RUN),
    (["review", "--state-dir", "{bad}"], STATE),
    (["status", "--state-dir", "{bad}", "{ok}"], STATE),
    (["status", "--state-dir", "{ok}/st", "{bad}"], (*RUN, "missing", "empty")),
    (["report", "{bad}", "-o", "{ok}/r.html"], (*RUN, "missing", "empty")),
    (["submit", "--nodes", "1", "--dry-run", "--state-dir", "{bad}", "--run-dir", "{ok}"], STATE),
    (["submit", "--nodes", "1", "--dry-run", "--run-dir", "{bad}", "--state-dir", "{ok}/s"], RUN),
    (["diagnose", "--device", "cpu", "--state-dir", "{bad}"], STATE),
    (["drill", "--local", "--work-dir", "{bad}"], RUN),
]


@pytest.mark.parametrize("kind", ["file", "below-file", "missing", "empty"])
@pytest.mark.parametrize(("argv", "failing"), COMMANDS, ids=[" ".join(c[0][:3]) for c in COMMANDS])
def test_an_unusable_directory_is_a_short_error_naming_it(
    tmp_path: Path, argv: list[str], failing: tuple[str, ...], kind: str
) -> None:
    if kind not in failing:
        pytest.skip(f"a {kind} directory is usable here")
    ok = tmp_path / "ok"
    ok.mkdir()
    (ok / "ledger.jsonl").write_text("")  # a run directory where a run dir is fine
    bad = _bad(tmp_path, kind)
    args = [a.replace("{bad}", str(bad)).replace("{ok}", str(ok)) for a in argv]
    env = {**ENV, "SLURM_JOB_NODELIST": "n1"} if argv[0] == "supervise" else ENV
    result = CliRunner().invoke(main, args, env=env)
    assert isinstance(result.exception, SystemExit), result.output  # not a traceback
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output
    assert str(bad) in result.output or bad.name in result.output, result.output
    assert len(result.output.strip().splitlines()) <= 4, result.output


def test_the_default_state_dir_is_the_controller_s_where_writable_else_the_user_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slurm_guard.cli import options

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    admin = tmp_path / "admin"
    monkeypatch.setattr(options, "DEFAULT_STATE_DIR", admin)
    assert default_state_dir() == admin  # creatable here: the controller's
    (tmp_path / "locked").write_text("")
    monkeypatch.setattr(options, "DEFAULT_STATE_DIR", tmp_path / "locked" / "state")
    assert default_state_dir() == tmp_path / "xdg" / "slurm-guard"  # not writable: the user's
    help_text = CliRunner().invoke(main, ["submit", "--help"]).output
    assert "~/.local/state/slurm-guard" in help_text and "Admin-owned" not in help_text
    assert str(DEFAULT_STATE_DIR) in help_text


def test_a_wrong_typed_guard_argument_is_a_guard_error_naming_it(tmp_path: Path) -> None:
    """`sg.Guard(..., run_dir=None)` failed inside pathlib with a raw TypeError."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import slurm_guard as sg

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DDP(torch.nn.Linear(2, 2))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        good: dict[str, object] = {
            "optimizer": opt,
            "loss_fn": lambda m, b: m(b).sum(),
            "run_dir": tmp_path,
        }
        for name, value in [
            ("run_dir", None),
            ("run_dir", 3),
            ("optimizer", "sgd"),
            ("loss_fn", 3),
            ("config", {"replay_every": 2}),
            ("scaler", 1.0),
            ("stateful", [opt]),
        ]:
            with pytest.raises(sg.GuardError, match=rf"^Guard: {name} must be .*, got "):
                sg.Guard(ddp, **{**good, name: value})  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
    with pytest.raises(sg.GuardError, match="ShardedGuard: run_dir must be a path"):
        sg.ShardedGuard(torch.nn.Linear(2, 2), opt, lambda m, b: m(b).sum(), None)  # type: ignore[arg-type]
