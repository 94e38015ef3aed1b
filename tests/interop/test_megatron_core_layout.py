"""--pipeline-model-parallel-layout with MTP letters against Megatron-Core's own
``PipelineParallelLayerLayout`` (slow: runs in the ``megatron-core`` virtual environment of
``test_megatron_core.py``): the layouts Megatron accepts with the MTP layers beside the loss
are accepted here with the same transformer layers in every (virtual) stage; those it refuses
are refused here for the same reason; those it accepts as a standalone MTP stage are accepted
here, with the same layers and as standalone, where that stage is just before the loss's
(the placement built here, with or without virtual stages), and refused in one line
elsewhere."""

import json
import subprocess

import pytest

from megatron.core.config import ConfigError
from megatron.core.pipeline_parallel import layer_layout as ll
from tests.interop.test_megatron_core import _env, mcore_python  # noqa: F401
from tests.unit.test_pipeline_layer_layout import MTP_LAYOUTS

pytestmark = pytest.mark.slow

HARNESS = __file__.replace("test_megatron_core_layout.py", "megatron_core_layout_harness.py")

ACCEPTED = [[text, pp, layers, 1] for text, layers, sizes in MTP_LAYOUTS for pp in sizes] + [
    ["Et|tmmL", 2, 2, 2], ["EtttmL", 1, 3, 1], ["Et|t|t|tmmL", 2, 4, 2]]
# Megatron's message -> ours, for the layouts both refuse.
REFUSED = {
    ("Et|tmL", 2, 2, 2): ("Number of mtp layers in layout must match mtp_num_layers",
                          "must match --mtp-num-layers"),
    ("Et|tmL", 2, 2, None): ("Number of mtp layers in layout must match mtp_num_layers",
                             "must match --mtp-num-layers"),
    ("Et|tL", 2, 2, 1): ("Number of mtp layers in layout must match mtp_num_layers",
                         "must match --mtp-num-layers"),
    ("Et|mtL", 2, 2, 1): ("decoder layers must be placed before MTP layers",
                          "must be placed before the MTP layers"),
    ("Et|t|m|||L", 2, 2, 1): ("MTP should be always in the last",
                              "must be in the last virtual pipeline stage"),
    ("Etm|mL", 2, 1, 2): ("must be in the same one virtual pipeline stage",
                          "must be in the same virtual pipeline stage"),
}
BUILT_STANDALONE = [["Et|t|t|m||L", 3, 3, 1], ["Etm||L", 3, 1, 1], ["Ettm|L", 2, 2, 1], ["Ettttmm|L", 2, 4, 2], ["Et|tttmm|L", 3, 4, 2],
                    ["Et|t|tmm|L", 4, 3, 2], ["Et|t|m|L", 2, 2, 1],
                    ["Et|(tt|)*5,tm|L", 2, 12, 1], ["E|t|t|t|tmm|L", 3, 4, 2]]


def test_mtp_letters_as_megatron_core_places_them(mcore_python, tmp_path):  # noqa: F811
    cases = ACCEPTED + [list(key) for key in REFUSED] + BUILT_STANDALONE
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = subprocess.run([str(mcore_python), HARNESS, "cases.json", "out.json"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads((tmp_path / "out.json").read_text())
    for (text, pp, layers, mtp), got in zip(cases, answers):
        if [text, pp, layers, mtp] in ACCEPTED + BUILT_STANDALONE:
            standalone = [text, pp, layers, mtp] in BUILT_STANDALONE
            assert got["error"] is None and got["standalone"] is standalone, (text, got)
            assert (ll.mtp_standalone_stage(text) is not None) is standalone, text
            counts = ll.layout_stage_counts(text, pp, layers, mtp)
            ours = {f"{p},{v}": list(range(ll.stage_offset(counts, p, v),
                                           ll.stage_offset(counts, p, v) + counts[p][v]))
                    for p in range(pp) for v in range(len(counts[0]))}
            assert ours == got["ids"], text
        else:
            theirs, ours = REFUSED[(text, pp, layers, mtp)]
            assert theirs in got["error"], (text, got)
            with pytest.raises(ConfigError, match=ours):
                ll.layout_stage_counts(text, pp, layers, mtp or 0)
