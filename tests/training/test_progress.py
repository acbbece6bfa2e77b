"""squash.training.progress: the run's one progress bar and the lines a run ends with, checked
against hand-written expectations."""

from squash.training import progress


def test_closing_lines_name_what_exists_and_the_commands_with_paths_filled_in(tmp_path):
    out = tmp_path / "my run"  # a space: the commands quote the paths
    (out / "logs").mkdir(parents=True)
    (out / "training.png").write_bytes(b"png")
    (out / "epoch_1").mkdir()
    (out / "epoch_1" / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"}')
    assert progress.closing_lines(out, out / "epoch_1").splitlines() == [
        f"Checkpoint: {out}/epoch_1",
        f"Picture:    {out}/training.png",
        f"Logs:       {out}/logs",
        "Next:",
        f"  squash chat --checkpoint '{out}/epoch_1'",
        f"  squash export '{out}/epoch_1' --format gguf --dtype q8_0 --output-dir '{out}/gguf'",
    ]
    (out / "training.png").unlink()  # no picture (no matplotlib), no checkpoint (none written)
    assert progress.closing_lines(out, None).splitlines() == [f"Logs:       {out}/logs"]


def test_squash_chat_is_suggested_only_for_a_checkpoint_with_a_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')  # the tiny OPT's
    assert not progress.has_chat_template(tmp_path)
    lines = progress.closing_lines(tmp_path, tmp_path).splitlines()
    assert lines == [f"Checkpoint: {tmp_path}", "Next:",
                     f"  squash export {tmp_path} --format gguf --dtype q8_0 --output-dir "
                     f"{tmp_path}/gguf"]  # fmt: skip
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # as SmolLM2's download
    assert progress.has_chat_template(tmp_path)


def test_the_bar_covers_every_epoch_and_starts_where_a_resumed_run_is(capsys):
    bar = progress.training_bar(total_steps=8, steps_done=3)
    bar.update(1)
    assert (bar.n, bar.total) == (4, 8)
    bar.close()
    assert " 4/8 [" in capsys.readouterr().err
