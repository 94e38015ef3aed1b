"""The README's lists of Megatron-LM flags with no effect here and refused flags are the ones
tools/flag_table.py generates from the flag registry."""

import pathlib

from megatron.training import arguments
from tools import flag_table

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_section_is_the_generated_table():
    readme = (ROOT / "README.md").read_text()
    assert flag_table.readme_section(readme) == flag_table.flag_table(), (
        "README.md's flag table is stale: run python tools/flag_table.py --write")


def test_the_table_names_every_registered_flag_with_its_reason():
    table = flag_table.flag_table()
    parser = arguments.build_parser()
    first = {}
    for action in parser._actions:
        if action.option_strings:
            first.setdefault(action.dest, action.option_strings[0])
    for registry in (arguments.NO_EFFECT_FLAGS, arguments.UNSUPPORTED_FLAGS):
        for dest, reason in registry.items():
            assert f"`{first[dest]}`" in table, dest
            assert " ".join(reason.split()[:3]) in " ".join(table.split()), reason
