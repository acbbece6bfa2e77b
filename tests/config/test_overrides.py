"""An override on the ``tune run`` command line that is not valid YAML ends the run with one line
naming it and the form that works (``export={gguf:[f16,q8_0]}`` -> ``export.gguf=[f16,q8_0]``),
before anything is written; the suggested forms read back as what was meant."""

import pytest
import yaml
from omegaconf import OmegaConf

from squash.config.overrides import bad_override, describe

from tests.helpers import tune_run

BAD = "export={gguf:[f16,q8_0]}"
MEANT = {"export": {"gguf": ["f16", "q8_0"]}}


def _error(override: str) -> yaml.YAMLError:
    try:
        OmegaConf.from_dotlist([override])
    except yaml.YAMLError as err:
        return err
    raise AssertionError(f"{override} parsed")


def test_the_message_names_the_override_and_forms_that_read_as_meant():
    assert bad_override(["--config", "x.yaml", "epochs=1", BAD, "a=[1,2"]) == BAD
    assert bad_override(["epochs=1", "export.gguf=[f16,q8_0]"]) is None
    message = describe(BAD, _error(BAD))
    assert message == (
        "the override 'export={gguf:[f16,q8_0]}' is not valid YAML (found unexpected ':'); give "
        "the key in dotted form: 'export.gguf=[f16,q8_0]' (or quote a mapping with a space after "
        "each colon: 'export={gguf: [f16, q8_0]}')"
    )
    for form in ("export.gguf=[f16,q8_0]", "export={gguf: [f16, q8_0]}"):
        assert OmegaConf.to_container(OmegaConf.from_dotlist([form])) == MEANT
    two = "export={gguf:[f16],onnx:[q8_0]}"
    assert "form: 'export.gguf=[f16]' 'export.onnx=[q8_0]' (or" in describe(two, _error(two))
    unclosed = describe("a=[1,2", _error("a=[1,2"))
    assert unclosed.endswith("quote the value or give each field as a.FIELD=VALUE")


@pytest.mark.slow
def test_tune_run_with_the_bad_override_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = tune_run(out, BAD, check=False)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert lines == ["squash_finetune: config error: " + describe(BAD, _error(BAD))]
    assert "Traceback" not in proc.stderr and not out.exists()
