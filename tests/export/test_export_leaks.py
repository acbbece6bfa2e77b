"""A refused ``squash export`` leaves nothing it created: the OPT architecture, which GGUF cannot
carry, is found only once the model is read, after ``--output-dir`` was made; the directories
the export made are removed again, and one that was there before stays as it was."""

from squash.cli import main as cli_main

from tests.helpers import REPO, tree

TINY = REPO / "assets" / "tiny_opt"  # a plain Hugging Face OPT checkpoint
REFUSAL = ("squash export: config.json architectures ['OPTForCausalLM'] cannot be exported to "
           "GGUF; supported: ['LlamaForCausalLM', 'Qwen2ForCausalLM']\n")  # fmt: skip


def test_an_unsupported_architecture_leaves_no_output_dir(tmp_path, capsys):
    before = tree(TINY)
    out = tmp_path / "new" / "deeper" / "gguf"
    assert cli_main(["export", str(TINY), "--output-dir", str(out)]) == 1
    assert capsys.readouterr().err == REFUSAL
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even "new"
    assert tree(TINY) == before


def test_directories_that_were_there_before_stay(tmp_path, capsys):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    for out, left in ((existing / "gguf", {"notes.txt": tree(existing)["notes.txt"]}), (empty, {})):
        assert cli_main(["export", str(TINY), "--output-dir", str(out)]) == 1
        assert capsys.readouterr().err == REFUSAL
        assert tree(out.parent if out != empty else empty) == left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "existing"]
