"""geoscale_fx.cli: ``main(argv)`` in process — its output, exit codes and refusals.

tests/core/test_bounds.py checks the paper table and one custom row; tests/test_export_kv_scales.py
a successful export. Here: the custom row's columns against ``calibration_row``, the
argument refusals, and the exit code of an export that cannot run.
"""
from __future__ import annotations

import pytest

from geoscale_fx import cli
from geoscale_fx.testing.paper_models import calibration_row


def test_custom_row_prints_the_calibration_row(capsys):
    argv = ["bounds", "--d", "512", "--dh", "64", "--layers", "4", "--heads", "8",
            "--seq-len", "256", "--delta", "1e-3", "--name", "tiny"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    row = calibration_row("tiny", 512, 64, 32, 256, 1e-3)
    cells = lines[-1].split()
    assert cells[:6] == ["tiny", "512", "64", "32", "256", "0.001"]
    assert cells[6:9] == [f"{row['gamma']:.3f}", f"{row['improvement']:.1f}x",
                          f"{row['alpha_min']:.4f}"]
    assert len(lines) == 3                                    # header, rule, one row


def test_partial_custom_architecture_is_refused():
    with pytest.raises(SystemExit, match="--d, --dh, --layers and --heads go together"):
        cli.main(["bounds", "--d", "512", "--dh", "64"])


@pytest.mark.parametrize("argv, message", [
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["export-kv-scales", "m", "--strategy", "row"], "invalid choice: 'row'"),
    (["bounds", "--d", "many"], "invalid int value: 'many'"),
    ([], "the following arguments are required: command"),
])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_export_of_a_directory_without_a_checkpoint_returns_2(tmp_path, capsys):
    assert cli.main(["export-kv-scales", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("geoscale export-kv-scales: checkpoint ")
    assert "neither model.safetensors nor model.safetensors.index.json" in err
    assert list(tmp_path.iterdir()) == []                      # nothing written


def test_export_of_a_named_model_needs_out(monkeypatch):
    loaded = []
    monkeypatch.setattr(cli, "_load_for_export", lambda args: loaded.append(args))
    with pytest.raises(SystemExit, match="--out DIR is needed"):
        cli.main(["export-kv-scales", "some.module:factory"])
    assert loaded == []                                        # refused before loading


def test_inspect_is_handed_its_own_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.inspection, "main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["inspect", "--model-type", "llama", "-h"]) == 7
    assert seen == [["--model-type", "llama", "-h"]]


def test_export_format_choices_are_the_writers(capsys):
    from geoscale_fx.cli import _build_parser
    from geoscale_fx.export.kv_scales import WRITERS

    parser = _build_parser()
    assert parser.parse_args(["export-kv-scales", "ckpt"]).format == "compressed-tensors"
    with pytest.raises(SystemExit):
        parser.parse_args(["export-kv-scales", "ckpt", "--format", "gguf"])
    assert "invalid choice: 'gguf'" in capsys.readouterr().err
    assert sorted(WRITERS) == ["compressed-tensors"]
