"""convert's "what to expect" message: measured SmolLM2 figures with their RESULTS section, the
recipe measured within +5% when the options miss it, and "not measured" where nothing was.

No model runs (the last test loads the tiny golden model and fails before quantizing).
"""

import logging
import re
from pathlib import Path

import pytest

from jaxserve.quant import expectations as ex

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "llama"
MIX = ("pydoc", "gnu-info")


def test_gptq_defaults_name_the_measured_delta_and_the_recipe():
    msg = ex.describe("int4-gptq", 64)  # convert's defaults at SmolLM2's group size
    assert "closest measured (g128/64, not g64)" in msg
    assert "+9.7% on GPL-3" in msg and "+10.4% on the Vim manual" in msg
    assert "§8a" in msg and "435 s" in msg
    assert "misses +5%" in msg
    assert ex.RECIPE_FLAGS in msg and "~70 minutes" in msg and "§8d" in msg


def test_the_recipe_itself_is_measured_within_5_percent():
    msg = ex.describe("int4-gptq", 64, True, 128, 65536, 512, MIX)
    assert msg.splitlines()[1].lstrip().startswith("measured (experiments/JOURNAL.md §8d)")
    assert "+3.7% on GPL-3" in msg and "median +4.5% over six held-out texts" in msg
    assert "misses" not in msg and ex.RECIPE_FLAGS not in msg
    m, exact = ex.find("int4-gptq", 64, True, 128, 65536, 512, MIX)
    assert exact and m.meets_target


def test_other_measured_options():
    awq = ex.describe("int4-awq", 64)
    assert "+13.2% on GPL-3" in awq and "§8b" in awq and ex.RECIPE_FLAGS in awq
    int8 = ex.describe("int8", 128)
    assert "+0.5% on GPL-3" in int8 and "§8b" in int8 and ex.RECIPE_FLAGS not in int8
    # a calibration sample of the recipe that misses on the six-text median
    other = ex.describe("int4-gptq", 64, True, 128, 98304, 512, MIX)
    assert "median +5.3%" in other and "misses +5%" in other and ex.RECIPE_FLAGS in other
    # g128: SmolLM2 cannot take it; the g128/64 figure is the closest
    g128 = ex.describe("int4-gptq", 128)
    assert "+9.7%" in g128 and "g128 was not measured" in g128


@pytest.mark.parametrize(
    "options",
    [
        ("int4-gptq", 64, True, 32),  # refine_steps never measured
        ("int4-gptq", 64, False, 0, 16384, 256),  # 256-token windows never measured
        ("int4-gptq", 64, True, 128, 65536, 512, ("gnu-info",)),
        ("int4-awq", 64, False, 0, 65536),
        ("int4-gptq", 32),  # g32 was scored only with the first, since replaced, GPTQ recipe
    ],
)
def test_unmeasured_options_say_not_measured(options):
    assert ex.find(*options) == (None, False)
    msg = ex.describe(*options)
    assert "not measured" in msg
    assert not re.search(r"[+-]\d+(\.\d+)?% on GPL-3 \(the reference", msg)  # no number made up
    assert ex.RECIPE_FLAGS in msg


def test_every_figure_and_section_is_in_results():
    results = (ROOT / "experiments" / "JOURNAL.md").read_text()
    headings = set(re.findall(r"^##+ (\d+[a-z]?)\.", results, flags=re.M))
    for m in ex.MEASURED:
        for sec in re.findall(r"§(\d+[a-z]?)", m.section):
            assert sec in headings, (m, sec)
        for fig in (m.gpl3, m.vim, m.median6):
            if fig is not None:
                assert ex.pct(fig) in results, (m, fig)
    flat = lambda s: " ".join(s.replace("\\\n", " ").split())
    assert ex.RECIPE_FLAGS in flat(results)
    assert ex.RECIPE_FLAGS in flat((ROOT / "BUILD.md").read_text())


def test_convert_logs_the_expectation_before_it_quantizes(tmp_path, caplog):
    from jaxserve.launch.convert import convert

    caplog.set_level(logging.INFO, logger="jaxserve.convert")
    # the golden model has no tokenizer: int4-gptq fails after the message, before quantizing
    with pytest.raises(ValueError, match="no tokenizer"):
        convert(str(GOLDEN), "int4-gptq", str(tmp_path / "x"), group_size=64)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "jaxserve.convert")
    assert "+9.7% on GPL-3" in text and ex.RECIPE_FLAGS in text
