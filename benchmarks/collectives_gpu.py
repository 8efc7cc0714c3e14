"""GPU check of the collective probe: the Kimi-K2.5 TP=8 decode schedule replayed through torchrun +
NCCL on WORLD GPUs of this host. Prints the burst per batch, the sweep with algbw/busbw, the latency fit.

python benchmarks/collectives_gpu.py WORLD [OUT.json]"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from decodescope.micro import bench as mb  # noqa: E402
from decodescope.report import micro_view as mbr
from decodescope.schema.params import load_params  # noqa: E402

params = load_params(Path(__file__).resolve().parents[1] / "params/kimi-k2.5-int4-8x-pcie.yaml")
params.microbench.world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 1
params.microbench.iterations, params.microbench.warmup = 50, 10
params.microbench.sweep_max_bytes = 256 << 20
run = Path(tempfile.mkdtemp())
(run / "data").mkdir()
(run / "logs").mkdir()
coll = mb.run_collectives_probe(params, run, device="cuda")
print(mbr.collectives_method_note(coll))
print(mbr.burst_table(coll).to_string())
print(mb.latency_fit(coll).to_string())
print(mbr.sweep_table(coll).to_string())
a = coll[coll["part"] == "all_to_all"]
print(a[["tokens_per_gpu", "bytes", "status", "time_us"]].to_string())
if len(sys.argv) > 2:
    coll.to_json(sys.argv[2], orient="records")
