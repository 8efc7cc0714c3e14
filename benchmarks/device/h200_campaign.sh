#!/usr/bin/env bash
# decodescope's campaign on a GPU host with torch 2.11.0+cu130 and no package index (an H200 reached through a
# command-running tool that moves at most 64 MiB a call). The vLLM 0.26.0 bundle (benchmarks/device/vllm-gpu-bundle.sh)
# and decodescope's wheelhouse (`decodescope
# wheelhouse --python-version 3.12 --host-packages ...`) travel as one tar in pieces, one piece per call
# (the tool's 64 MiB a call), each copied out of the tree at once; the campaign then runs in its own
# process session, from a copy of the tree, so that later calls can poll it and a changed tree never
# reaches a running campaign.
# Build the bundle with `vllm-gpu-bundle.sh OUT compressed-tensors==0.17.0 loguru setproctitle`: without setproctitle
# vLLM cannot name its processes (VLLM::EngineCore, VLLM::Worker) and 04 tells them apart by their place in the tree.
#   pack BUNDLE WHEELHOUSE (here) the bundle's parts and the wheelhouse as one tar in 28 MiB pieces (PIECE=),
#                          .gpu/p0..: a piece and the working tree (31 MiB at 29f382e; 33 MiB pieces were
#                          refused with it) must pass together in 64 MiB
#   stash                  copy this call's pieces to $VB
#   setup                  check and unpack the pieces; vLLM onto $SITE, the wheelhouse into $DS
#   start JOB              copy the tree to $REPO and start `decodescope run PARAMS ARGS` there
#   queue 'JOB' ..         the same for several runs, one after the other, in one background session
#   gputests [PYTEST ARGS] the gpu-marked tests, with vLLM and the wheelhouse on the path (log to $OUT)
#   resume 'JOB' ..        copy lib/, notebooks/ and params/ again and queue the jobs again, each with --resume
#                          its params' latest run directory (phases and variants already ok are skipped; a job
#                          with none starts afresh)
#   poll SECONDS           wait until the run ends or SECONDS pass; print the log's tail (300 at most: a lent
#                          machine was released under a 560 s poll, and its run's files with it)
#   collect                each job's part of the queue log into its run directory's logs/decodescope-run.log (a
#                          resumed job's into decodescope-run.2.log, .3, ..: no log is overwritten); tar the run
#                          directories into 15 MiB pieces (traces left out when the whole would pass
#                          110 MiB) and put the first four into $OUT: a call brings back ~64 MiB in all (on
#                          2026-12-05 a fifth to eighth piece came back "left out (total)")
#   more N                 the pieces from N on, four a call, into $OUT (collect says which are left)
# One H100 or H200, 30 minutes (issue 52, 2026-12-06: benchmarks/results/h100_vllm_qwen3-30b-a3b-16l/spec_20261206):
# the tree travels with every piece, so with a 28 MiB tree use PIECE=32M (six pieces for the bundle and a
# wheelhouse without jupyterlab, babel, jupyter_builder, jupyterlab_server, json5, jupyter_lsp, notebook_shim,
# which papermill never imports); calls in a row keep the machine (30 s idle release). The shared working tree
# may hold others' unfinished edits: carry `git archive HEAD lib notebooks params` as .gpu/p<last>/src.tar and
# unpack it over lib/ notebooks/ params/ before setup. Baseline with all phases but 05 (about 4 min), variants
# with 01 only (about 100 s each with the compile cache warm): seven variants and the baseline in 15 minutes.
# A JOB is '[VAR=VALUE ..] PARAMS [ARGS..]': the assignments go to decodescope's own environment, where 03's
# probes run (server.env does not reach them), e.g. 'NCCL_P2P_DISABLE=1 params/h200x2-qwen3moe-pcie.yaml'.
# CLIENT_CPUS=LIST in this script's environment runs decodescope under taskset -c LIST (the pinned params put
# the server on the other half of the cores with server.cpus). start, queue and resume refuse while a run goes.
#
# Several GPUs (nvidia-h200-x2 / -x4 / -x8): the same steps; each start, queue, resume and poll call returns within
# the tool's 10 minutes (the runs go on in the background), so the campaign is one queue call, polled, and after a
# stop (a failed phase, a killed process) one resume call with the same jobs:
#   CLIENT_CPUS=16-31 bash benchmarks/device/h200_campaign.sh queue params/h200x2-qwen3moe.yaml \
#       'NCCL_P2P_DISABLE=1 params/h200x2-qwen3moe-pcie.yaml'
#   bash benchmarks/device/h200_campaign.sh poll 300                         # again until "== finished"
#   CLIENT_CPUS=16-31 bash benchmarks/device/h200_campaign.sh resume params/h200x2-qwen3moe.yaml \
#       'NCCL_P2P_DISABLE=1 params/h200x2-qwen3moe-pcie.yaml'         # only after a stop
#   x4: CLIENT_CPUS=32-63 .. queue params/h200x4-kimi-int4.yaml; x8: CLIENT_CPUS=64-127 .. queue
#   params/h200x8-kimi-int4.yaml 'NCCL_P2P_DISABLE=1 params/h200x8-kimi-int4-pcie.yaml'. On a short lease, name
#   the variants: 'params/h200x2-qwen3moe.yaml --variants pcie-like no-custom-ar' (a one-GPU campaign with three
#   variants took 14-19 min; at tensor-parallel 2 with five, and the pcie run after it, expect more than one
#   session's 30 min of device time). A fresh machine has none of this: resume works within one lease only
#   (collect before it ends).
set -u
VB=/root/vb SITE=/tmp/site DS=/tmp/ds REPO=/root/ds-repo LOG=/root/ds-run.log QPID=/root/ds-queue.pid
# --target puts the wheels' data files (nbconvert's templates) under $DS/share, where jupyter looks when told
export PYTHONPATH=$REPO/lib:$DS:$SITE JUPYTER_PATH=$DS/share/jupyter VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# NVLink multicast stays off (the GPU machines this ran on forbade it); kept set for everything started here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
running() { pgrep -f "decodescope.cli.main run" >/dev/null || { [ -f $QPID ] && kill -0 "$(cat $QPID)" 2>/dev/null; }; }
# job_line JOB [resume]: the shell line that runs JOB ('[VAR=VALUE ..] PARAMS [ARGS..]') in $REPO; with resume, with
# --resume the latest run directory of PARAMS' run name, where there is one
job_line() {
  local words envs=() extra="" name last; read -ra words <<< "$1"
  while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} == *=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  [ ${#words[@]} -gt 0 ] || { echo "no PARAMS in job '$1'" >&2; return 1; }
  if [ "${2:-}" = resume ]; then
    name=$(cd $REPO && python3 -c 'import sys; from decodescope.schema.params import load_params
print(load_params(sys.argv[1]).run_name)' "${words[0]}") || return 1
    last=$(ls -d $REPO/outputs/*Z-"$name"/ 2>/dev/null | tail -1)
    [ -n "$last" ] && extra=" --resume ${last%/}"
  fi
  echo "env ${envs[*]:-} ${CLIENT_CPUS:+taskset -c $CLIENT_CPUS }python3 -m decodescope.cli.main run ${words[*]}$extra"
}
# queue_jobs [resume] JOB..: the jobs one after the other in one background session, logged to $LOG
queue_jobs() {
  local how="" q=/root/ds-queue.sh line; [ "${1:-}" = resume ] && { how=resume; shift; }
  [ $# -gt 0 ] || { echo "no JOB given"; return 1; }
  running && { echo "a run is going: poll it (or end it) first"; return 1; }
  rm -rf $REPO/lib $REPO/notebooks $REPO/params && cp -r lib notebooks params $REPO/
  echo "cd $REPO" > $q
  for job in "$@"; do
    line=$(job_line "$job" $how) || return 1
    echo "echo \"== queue: $line (\$(date -u +%T))\"; $line; echo \"== queue: exit \$? (\$(date -u +%T))\"" >> $q
  done
  [ -n "$how" ] || : > $LOG
  setsid nohup bash $q >> $LOG 2>&1 < /dev/null & echo $! > $QPID
  sleep 5; cat $q; tail -5 $LOG
}
case "${1:?pack|stash|setup|start|queue|gputests|resume|poll|collect|more}" in
pack)
  set -e; rm -rf .gpu/stage .gpu/p? && mkdir -p .gpu/stage/wh
  cp "${2:?bundle parts dir}"/* .gpu/stage/ && cp "${3:?wheelhouse}"/*.whl .gpu/stage/wh/ && rm -f .gpu/stage/wh/decodescope-*.whl
  tar -C .gpu/stage -cf - . | (cd .gpu && split -b "${PIECE:-28M}" -d - piece-) && (cd .gpu && sha256sum piece-* > PIECES.SHA256)
  i=0; for f in .gpu/piece-*; do mkdir -p .gpu/p$i && mv $f .gpu/p$i/; i=$((i+1)); done; cp .gpu/PIECES.SHA256 .gpu/p$((i-1))/
  ls -l .gpu/p* ;;
stash)
  mkdir -p $VB && cp .gpu/p*/* $VB/ && ls -l $VB ;;
setup)
  set -e
  (cd $VB && sha256sum -c PIECES.SHA256 && mkdir -p x && cat piece-* | tar -C x -xf -)
  (cd $VB/x && sha256sum -c SHA256SUMS && mkdir -p $SITE && cat vllm-site.tgz.part-* | tar -C $SITE -xzf -)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $DS $VB/x/wh/*.whl
  rm -rf $REPO && mkdir -p $REPO && tar -C "$PWD" --exclude=./.gpu --exclude=./.venv -cf - . | tar -C $REPO -xf -
  cd $REPO && python3 -c "import torch, vllm, papermill, plotly, decodescope; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m ;;
start)
  shift; queue_jobs "$*" ;;
queue)
  shift; queue_jobs "$@" ;;
gputests)
  shift; cd $REPO && python3 -m pytest -p no:cacheprovider -m gpu -s -q "$@" 2>&1 | tee "$OUT/gputests.log" | tail -40 ;;
resume)
  shift; queue_jobs resume "$@" ;;
poll)
  end=$((SECONDS + ${2:-60})); while running && [ $SECONDS -lt $end ]; do sleep 5; done
  running && echo "== still running" || echo "== finished"; tail -${3:-40} $LOG ;;
collect)
  python3 - "$LOG" "$REPO/outputs" <<'PY'
import pathlib, re, sys
log, outputs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
jobs, cur = [], None  # the queue log cut at each job's "== queue: <line>" (its "== queue: exit" ends it)
for line in log.read_text(errors="replace").splitlines(keepends=True) if log.exists() else []:
    if line.startswith("== queue: ") and not line.startswith("== queue: exit"):
        cur = [line]; jobs.append(cur)
    elif cur is not None:
        cur.append(line)
for job in jobs:
    text = "".join(job)
    m = re.search(r"decodescope run \S*outputs/([^/\s]+)", text)
    if not m or not (outputs / m.group(1)).is_dir():
        continue
    logs = outputs / m.group(1) / "logs"; logs.mkdir(exist_ok=True)
    i = 1
    while True:  # a log already there is kept: this job's goes beside it, unless it is the same
        dest = logs / ("decodescope-run.log" if i == 1 else f"decodescope-run.{i}.log")
        if not dest.exists() or dest.read_text(errors="replace") == text:
            break
        i += 1
    dest.write_text(text); print("log:", dest)
PY
  names=$(cd $REPO/outputs && ls -d */ | tr -d /)
  tar -C $REPO/outputs -czf /root/run.tgz $names
  [ "$(stat -c %s /root/run.tgz)" -gt $((110 << 20)) ] && tar -C $REPO/outputs --exclude='*trace.json*' -czf /root/run.tgz $names
  rm -rf /root/pieces && mkdir /root/pieces && split -b 15M -d /root/run.tgz /root/pieces/run.tgz.part-
  (cd /root/pieces && sha256sum run.tgz.part-* > SHA256SUMS) && cp /root/pieces/SHA256SUMS "$OUT/"
  bash "$0" more 0 ;;
more)
  n=$(ls /root/pieces/run.tgz.part-* | wc -l); first=${2:?the first piece}
  for i in $(seq "$first" $((first + 3))); do p=/root/pieces/run.tgz.part-$(printf %02d "$i"); [ -f "$p" ] && cp "$p" "$OUT/"; done
  ls -l "$OUT"; [ $((first + 4)) -lt "$n" ] && echo "== $((n - first - 4)) pieces left: more $((first + 4))" || echo "== all $n pieces out" ;;
esac
