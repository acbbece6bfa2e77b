"""Command-line overrides (``key=value`` after ``tune run RECIPE --config FILE``) that are not
valid YAML, named in one line with the form that works.

torchtune's ``@config.parse`` hands each override to OmegaConf, which reads the value as YAML: a
flow mapping needs a space after each colon, so ``export={gguf:[f16,q8_0]}`` ends in PyYAML's
``ScannerError`` traceback before the recipe runs. Each recipe's ``__main__`` runs its
``recipe_main`` inside :func:`overrides_in_one_line`, which turns that into::

    squash_finetune: config error: the override 'export={gguf:[f16,q8_0]}' is not valid YAML
    (found unexpected ':'); give the key in dotted form: 'export.gguf=[f16,q8_0]' (or quote a
    mapping with a space after each colon: 'export={gguf: [f16, q8_0]}')

It also reads the ``--config`` file first (:func:`squash.config.validate.load_config`): a
directory, a YAML syntax error, a top-level list or an empty file is one line naming the file,
the line ``squash validate`` prints, where torchtune's parser would end in a traceback.
"""

import re
import sys
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

import yaml


@contextmanager
def overrides_in_one_line(recipe: str, argv: Optional[List[str]] = None) -> Iterator[None]:
    """Run the body (a recipe's ``recipe_main``, which parses the command line) once its
    ``--config`` file reads as a config; a file that does not, or a YAML error in an override,
    becomes ``RECIPE: config error: ...`` naming it, and exit status 1.

    Args:
        recipe (str): the recipe's name, for the message.
        argv (Optional[List[str]]): the command line's arguments. Default: ``sys.argv[1:]``.

    Raises:
        SystemExit: status 1, after printing the message.
    """
    from squash.config.keys import ConfigKeyError
    from squash.config.validate import load_config

    argv = sys.argv[1:] if argv is None else argv
    path = config_argument(argv)
    if path is not None:
        try:
            load_config(path)
        except ConfigKeyError as err:
            print(f"{recipe}: config error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    try:
        yield
    except yaml.YAMLError as err:
        override = bad_override(argv)
        if override is None:
            raise
        print(f"{recipe}: config error: {describe(override, err)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def config_argument(argv: List[str]) -> Optional[str]:
    """The value of ``--config`` (``--config FILE`` or ``--config=FILE``), if given."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg[len("--config="):]
    return None


def bad_override(argv: List[str]) -> Optional[str]:
    """The first ``key=value`` argument whose value OmegaConf cannot read, if any."""
    from omegaconf import OmegaConf

    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        try:
            OmegaConf.from_dotlist([arg[1:] if arg.startswith("~") else arg])
        except yaml.YAMLError:
            return arg
    return None


def describe(override: str, err: yaml.YAMLError) -> str:
    """One line naming ``override``, what YAML found, and the dotted form(s) to write instead."""
    key, value = override.split("=", 1)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    text = f"the override '{override}' is not valid YAML ({problem})"
    mapping = _as_mapping(value)
    if mapping is None:
        return f"{text}; quote the value or give each field as {key}.FIELD=VALUE"
    dotted = " ".join(f"'{key}.{k}={_compact(v)}'" for k, v in mapping.items())
    spaced = re.sub(r":(?=\S)", ": ", re.sub(r",(?=\S)", ", ", value))
    return (
        f"{text}; give the key in dotted form: {dotted} (or quote a mapping with a space after "
        f"each colon: '{key}={spaced}')"
    )


def _as_mapping(value: str) -> Optional[dict]:
    """``value`` as a YAML flow mapping once each colon is followed by a space, if it is one."""
    if not value.strip().startswith("{"):
        return None
    try:
        parsed = yaml.safe_load(re.sub(r":(?=\S)", ": ", value))
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, dict) and parsed else None


def _compact(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_compact(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_compact(v)}" for k, v in value.items()) + "}"
    return str(value)
