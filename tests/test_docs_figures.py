"""The figures of README.md and docs/lm.md are generated (docs/generate.py) from results files
of the current code: each block equals its rendering, a rendering equals what the run printed,
and each recorded run is of today's preset, corpus and oldest stack."""

import dataclasses
import importlib.util
import json
import pathlib

import pytest

from diloco_jax.lm import corpus
from diloco_jax.lm.config import make_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)
# record -> (preset, stack)
RECORDS = {
    "make_run": ("default", "oldest"),
    "compare_quick": ("quick", "oldest"),
    "compare_quick_newest": ("quick", "newest"),
}


def test_every_generated_block_is_its_rendering():
    generated = generate.blocks()
    used = set()
    for path in generate.DOCS:
        text = path.read_text()
        used |= {m.group(2) for m in generate.BLOCK.finditer(text)}
        assert generate.rewrite(text, generated) == text, f"run docs/generate.py ({path.name})"
    assert used == set(generated)


@pytest.mark.parametrize("name, preset, stack", [(k, *v) for k, v in RECORDS.items()])
def test_a_record_renders_as_its_run_printed_and_is_of_the_current_code(name, preset, stack):
    record = generate.load(name)
    assert generate.printed_table(record) == record["printed"]
    config = record["summary"]["config"]
    want = json.loads(json.dumps(dataclasses.asdict(make_config(preset))))
    assert config["config"] == want
    data = config["data"]
    assert (data["spec"], data["num_bytes"]) == ("bundled", want["max_bytes"])
    if want["max_bytes"] == corpus.NUM_BYTES:
        assert data["sha256"] == corpus.SHA256
    pins = (ROOT / "constraints" / "oldest.txt").read_text()
    oldest = f"jax=={config['jax_version']}\n" in pins and record["python"].startswith("3.11.")
    assert oldest == (stack == "oldest")
