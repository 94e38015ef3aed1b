"""Megatron-Core's side of the pipeline-layout interoperability test: run inside the virtual
environment that has the ``megatron-core`` package (and not this project), one process.

    python megatron_core_layout_harness.py CASES_JSON OUT_JSON

CASES_JSON is a list of ``[layout, pp, num_layers, mtp_num_layers]``. For each case OUT_JSON
gets ``{"error": <the assertion's message or null>, "standalone": <what
validate_layer_layout returned>, "ids": {"<pp>,<vp>": [transformer layer ids]}}`` from
Megatron-Core's ``PipelineParallelLayerLayout``.
"""

import json
import sys


def _one(layout, pp, num_layers, mtp_num_layers):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    try:
        parsed = PipelineParallelLayerLayout(layout, pp)
        standalone = parsed.validate_layer_layout(num_layers, mtp_num_layers)
    except AssertionError as err:
        return {"error": str(err), "standalone": None, "ids": {}}
    vp = parsed.virtual_pipeline_model_parallel_size
    # The layer ids are read for a given (pp, vp) rank; the query needs vp's world size.
    parallel_state.get_virtual_pipeline_model_parallel_world_size = (
        lambda: vp if vp > 1 else None)
    ids = {f"{p},{v}": parsed.get_layer_id_list(LayerType.decoder, vp_stage=v, pp_rank=p)
           for p in range(pp) for v in range(vp)}
    return {"error": None, "standalone": standalone, "ids": ids}


def main(cases_path, out_path):
    with open(cases_path) as f:
        cases = json.load(f)
    with open(out_path, "w") as f:
        json.dump([_one(*case) for case in cases], f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
