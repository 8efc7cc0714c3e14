#!/usr/bin/env bash
# decodescope's campaign on the lent H200 machine, which has torch 2.11.0+cu130 and no package index.
# The vLLM 0.26.0 bundle (shared/tools/vllm-gpu-bundle.sh) and decodescope's wheelhouse (`decodescope
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
#   start PARAMS [ARGS..]  copy the tree to $REPO and start `decodescope run PARAMS ARGS` there
#   queue 'PARAMS ARGS' .. the same for several runs, one after the other, in one background session
#   gputests [PYTEST ARGS] the gpu-marked tests, with vLLM and the wheelhouse on the path (log to $OUT)
#   resume PARAMS          copy lib/, notebooks/ and params/ again and resume the last run
#   poll SECONDS           wait until the run ends or SECONDS pass; print the log's tail (300 at most: a lent
#                          machine was released under a 560 s poll, and its run's files with it)
#   collect                tar the run directories into $OUT (pieces of at most 15 MiB; traces left out when
#                          the whole would pass the tool's 8 files)
set -u
VB=/root/vb SITE=/tmp/site DS=/tmp/ds REPO=/root/ds-repo LOG=/root/ds-run.log QPID=/root/ds-queue.pid
# --target puts the wheels' data files (nbconvert's templates) under $DS/share, where jupyter looks when told
export PYTHONPATH=$REPO/lib:$DS:$SITE JUPYTER_PATH=$DS/share/jupyter VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
running() { pgrep -f "decodescope.cli.main run" >/dev/null || { [ -f $QPID ] && kill -0 "$(cat $QPID)" 2>/dev/null; }; }
case "${1:?pack|stash|setup|start|resume|poll|collect}" in
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
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ;;
start)
  shift; rm -rf $REPO/lib $REPO/notebooks $REPO/params && cp -r lib notebooks params $REPO/
  cd $REPO && setsid nohup python3 -m decodescope.cli.main run "$@" > $LOG 2>&1 < /dev/null &
  sleep 5; cat $LOG ;;
queue)
  shift; rm -rf $REPO/lib $REPO/notebooks $REPO/params && cp -r lib notebooks params $REPO/
  : > $LOG; q=/root/ds-queue.sh; echo 'cd '$REPO > $q
  for job in "$@"; do
    echo "echo \"== queue: decodescope run $job (\$(date -u +%T))\"; python3 -m decodescope.cli.main run $job; echo \"== queue: exit \$? (\$(date -u +%T))\"" >> $q
  done
  setsid nohup bash $q >> $LOG 2>&1 < /dev/null & echo $! > $QPID
  sleep 5; cat $q $LOG ;;
gputests)
  shift; cd $REPO && python3 -m pytest -p no:cacheprovider -m gpu -s -q "$@" 2>&1 | tee "$OUT/gputests.log" | tail -40 ;;
resume)
  rm -rf $REPO/lib $REPO/notebooks $REPO/params && cp -r lib notebooks params $REPO/
  last=$(ls -d $REPO/outputs/*/ | tail -1)
  cd $REPO && setsid nohup python3 -m decodescope.cli.main run "${2:?resume PARAMS}" --resume "$last" >> $LOG 2>&1 < /dev/null &
  sleep 5; tail -5 $LOG ;;
poll)
  end=$((SECONDS + ${2:-60})); while running && [ $SECONDS -lt $end ]; do sleep 5; done
  running && echo "== still running" || echo "== finished"; tail -${3:-40} $LOG ;;
collect)
  names=$(cd $REPO/outputs && ls -d */ | tr -d /)
  for n in $names; do cp $LOG "$REPO/outputs/$n/logs/decodescope-run.log" 2>/dev/null; done
  tar -C $REPO/outputs -czf /root/run.tgz $names
  [ "$(stat -c %s /root/run.tgz)" -gt $((110 << 20)) ] && tar -C $REPO/outputs --exclude='*trace.json*' -czf /root/run.tgz $names
  split -b 15M -d /root/run.tgz "$OUT/run.tgz.part-" && ls -l $OUT ;;
esac
