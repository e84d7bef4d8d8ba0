"""`dgr artifacts` on files that are not what it asks for: each a one-line error naming the file
and what is wrong (exit 1), or a usage error (exit 2), never a traceback, and nothing created."""

from __future__ import annotations

from pathlib import Path

import pytest
from dgr_artifacts.cli import main
from dgr_artifacts.manifest import ArtifactManifest, write_manifest


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such manifest file"),
        (b"nope", "not a DGR artifact manifest: Invalid JSON: expected ident at line 1"),
        (b"{}", "not a DGR artifact manifest: 6 problems:\n  model_fingerprint: Field required\n"),
        (b"GGUF\x03\x00\xc3\x28", "cannot read it as a JSON manifest: 'utf-8' codec can't decode"),
    ],
)
@pytest.mark.parametrize("command", ["verify", "subset", "provision"])
def test_a_file_that_is_not_a_manifest_is_named(
    command: str,
    content: bytes | None,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A GGUF given where the manifest goes (`dgr artifacts subset model.gguf`) was a
    UnicodeDecodeError traceback, a JSON file of something else a pydantic one."""
    path = tmp_path / "m.json"
    if content is not None:
        path.write_bytes(content)
    rest = {
        "verify": [str(tmp_path)],
        "subset": ["--layers", "0:2"],
        "provision": ["--source", str(tmp_path), "--root", str(tmp_path / "root")],
    }[command]
    assert main([command, str(path), *rest]) == 1
    err = capsys.readouterr().err
    # one line, or one per problem after the count (the 6 fields `{}` lacks)
    lines = 7 if content == b"{}" else 1
    assert err.startswith(f"error: {path}: {message}") and err.count("\n") == lines, err
    assert not (tmp_path / "root").exists()


def test_verify_into_a_missing_directory_creates_nothing(
    manifest: ArtifactManifest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It made the directory (for its resume state) and then reported every file missing."""
    path = tmp_path / "m.json"
    write_manifest(manifest, path)
    model_dir = tmp_path / "no-such-dir"
    assert main(["verify", str(path), str(model_dir)]) == 1
    assert capsys.readouterr().err == f"error: {model_dir}: no such model directory\n"
    assert not model_dir.exists()


def test_manifest_options(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out into a directory that is not there is refused before hashing the model (it was an
    OSError traceback after); --chunk-size 0 or -5 are usage errors (they were a pydantic and a
    ValueError traceback)."""
    out = tmp_path / "missing" / "m.json"
    assert main(["manifest", str(smollm2), "--out", str(out)]) == 1
    assert capsys.readouterr().err == f"error: {out}: its directory does not exist\n"
    for size in ("0", "-5", "x"):
        with pytest.raises(SystemExit) as done:
            main(
                ["manifest", str(smollm2), "--out", str(tmp_path / "m.json"), "--chunk-size", size]
            )
        assert done.value.code == 2
        assert f"argument --chunk-size: '{size}' is not a number of bytes >= 1" in (
            capsys.readouterr().err
        )
