"""``squash validate`` is ``tune run``'s own check: a config file that is not a config (missing,
a directory, a YAML syntax error, a top-level list, empty) and a config without a block the
recipe needs are refused by both with the same message, one line naming the file or the key.
Here through the two entry points in-process: the recipes' ``__main__`` guard
(:func:`overrides_in_one_line`) and recipe class, and ``squash.cli.main``; the real ``tune run``
is in tests/test_validate.py."""

import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG

sys.path.insert(0, str(REPO / "recipes"))
import squash_distill  # noqa: E402
import squash_eval  # noqa: E402
import squash_finetune  # noqa: E402

from squash.cli import main as cli_main  # noqa: E402
from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.config.overrides import config_argument, overrides_in_one_line  # noqa: E402
from squash.config.validate import load_config  # noqa: E402

MAPPING = "a config is a YAML mapping of keys (model: ..., tokenizer: ...)"


def bad_files(tmp_path):
    """``{case: (path, message)}``: each config file that is not a config, and its message."""
    cases = {}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cases["empty"] = (empty, f"config file {empty} is empty: {MAPPING}")
    comments = tmp_path / "comments.yaml"
    comments.write_text("# nothing but a comment\n\n")
    cases["comments"] = (comments, f"config file {comments} is empty: {MAPPING}")
    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("batch_size: 4\nmodel: [1, 2\n")  # an unclosed flow sequence
    cases["syntax"] = (syntax, f"config file {syntax} is not valid YAML: did not find expected ',' "
                               "or ']' (line 3, column 1)")  # fmt: skip
    tab = tmp_path / "tab.yaml"
    tab.write_text("model:\n\tlora_rank: 8\n")
    cases["tab"] = (tab, f"config file {tab} is not valid YAML: found character that cannot start "
                         "any token (line 2, column 1)")  # fmt: skip
    listed = tmp_path / "list.yaml"
    listed.write_text("- model\n- tokenizer\n")
    cases["list"] = (listed, f"config file {listed} holds a YAML list, not a mapping of config keys "
                             "(model: ..., tokenizer: ...)")  # fmt: skip
    directory = tmp_path / "configs"
    directory.mkdir()
    cases["directory"] = (directory, f"config file {directory} is a directory; give a YAML config file")
    missing = tmp_path / "missing.yaml"
    cases["missing"] = (missing, f"config file {missing} does not exist")
    return cases


CASES = ["empty", "comments", "syntax", "tab", "list", "directory", "missing"]


@pytest.mark.parametrize("case", CASES)
def test_a_file_that_is_not_a_config_is_one_line_from_both(case, tmp_path, capsys):
    path, message = bad_files(tmp_path)[case]
    with pytest.raises(ConfigKeyError) as info:
        load_config(str(path))
    assert str(info.value) == message
    # a recipe's entry point, as `tune run` runs it: before torchtune's parser reads the file
    argv = ["--config", str(path), "output_dir=/nonexistent/never"]
    with pytest.raises(SystemExit) as exit_info:
        with overrides_in_one_line("squash_finetune", argv):
            raise AssertionError("the recipe ran")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == f"squash_finetune: config error: {message}\n"
    assert cli_main(["validate", str(path)]) == 1
    assert capsys.readouterr().err == f"squash validate: {path}: config error: {message}\n"


def test_the_config_argument_is_found_in_both_forms():
    assert config_argument(["--config", "a.yaml", "x=1"]) == "a.yaml"
    assert config_argument(["x=1", "--config=b.yaml"]) == "b.yaml"
    assert config_argument(["x=1"]) is None


@pytest.mark.parametrize("recipe, config, key", [
    (squash_finetune.SquashFinetuneRecipeSingleDevice, TINY_CONFIG, "model"),
    (squash_finetune.SquashFinetuneRecipeSingleDevice, TINY_CONFIG, "tokenizer"),
    (squash_finetune.SquashFinetuneRecipeSingleDevice, TINY_CONFIG, "dataset"),
    (squash_distill.SquashDistillRecipeSingleDevice, REPO / "configs" / "opt_tiny_distill.yaml", "teacher"),
    (squash_eval.SquashEvalRecipe, REPO / "configs" / "opt_tiny_eval.yaml", "checkpointer"),
])  # fmt: skip
def test_a_config_without_a_block_the_recipe_needs_is_refused_by_both(recipe, config, key, tmp_path, capsys):
    cfg = OmegaConf.load(config)
    cfg.output_dir = str(tmp_path / "out")
    del cfg[key]
    path = tmp_path / f"no_{key}.yaml"
    OmegaConf.save(cfg, path)
    with pytest.raises(ConfigKeyError) as info:
        recipe(load_config(str(path)))
    assert str(info.value) == f"Missing config key: {key}"
    assert cli_main(["validate", str(path), "--recipe", recipe.__module__]) == 1
    assert capsys.readouterr().err == f"squash validate: {path}: config error: Missing config key: {key}\n"
    assert not (tmp_path / "out").exists()
