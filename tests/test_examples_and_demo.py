"""Every example and the demo run end to end."""

import subprocess
import sys

from hostswap.examples import export_and_run


def test_export_and_run_example(tmp_path, capsys):
    assert export_and_run.main(["--device", "cpu", "--out", str(tmp_path / "ex")]) == 0
    out = capsys.readouterr().out
    assert "matches plain PyTorch: True" in out and "Access order" in out


def test_demo_command(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hostswap.cli", "demo", "--out", str(tmp_path), "--device", "cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for needle in ("applying the weight-offload pass", "Floor set by kernels", "two forwards per policy", "planned", "lru"):
        assert needle in result.stdout
    assert "NO" not in result.stdout.split("two forwards per policy")[1]
    assert (tmp_path / "demo.pte").exists() and (tmp_path / "demo.ptd").exists()


def test_train_with_activation_offload_example(capsys, tmp_path):
    from hostswap.examples import train_with_activation_offload

    assert train_with_activation_offload.main(["--device", "cpu", "--compiler", "eager", "--plot", str(tmp_path / "t.svg")]) == 0
    out = capsys.readouterr().out
    assert "3 of 6 layers offloaded" in out and "bitwise equal to no offload: True" in out
    assert (tmp_path / "t.svg").exists()
