#!/usr/bin/env bash
# launch.sh: starts every role of the system (parameter server, trainer, inference workers) and supervises them.
#
#   bash launch.sh local [flags]     this machine: build tokenizer + base policy if missing, eval before, run RL with
#                                    a server, a trainer (--trainer_procs JAX processes) and --workers workers,
#                                    restarting any that die, eval after, print the before/after pass@k table.
#   bash launch.sh stop [--run_dir=D]   SIGTERM every process of a local run (they checkpoint / drain), then kill.
#   bash launch.sh test [pytest args]   install test deps into .venv and run the CPU suite (8 fake devices).
#   bash launch.sh v5p-N | v6e-N --tpu=NAME --zone=Z [--infer_tpu=NAME2] [--dry_run]
#                                    TPU pods: the trainer runs on every host of slice --tpu (one JAX process per
#                                    host, jax.distributed over the slice), the server on its host 0, one inference
#                                    worker per host of slice --infer_tpu (default: the same slice size, named
#                                    NAME-infer), each using its local chips. --dry_run prints the exact commands.
#
# local flags: --run_dir=runs/local --workers=2 --trainer_procs=1 --steps=N --init_checkpoint=HF_DIR
#   --tokenizer=PATH --train_jsonl=F --eval_jsonl=F --port=5555 --max_new_tokens=8 --template=plain
#   --worker_args="--lease_s=30 ..." --skip_eval;
#   anything after "--" goes to train.py.
# Layout of a run dir: logs/<role>.log, pids/<role>.pid, token (server secret), tokenizer-arithmetic.model, base/ (HF
# checkpoint of the warm-started policy), ckpt/ (trainer), server/ (server persistence), final/, eval_*.json.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"

# Create the virtualenv and install a requirements file once; a stamp keyed on the files' hash makes reruns free.
setup_venv() {
  local req="$1" stamp
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  stamp="$VENV/.installed-$(basename "$req")-$(cat "$req" requirements.txt | sha1sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -r "$req"
    touch "$stamp"
  fi
  PY="$VENV/bin/python"
}

# ---------------------------------------------------------------------------------------------------------------
# local: supervised processes on this machine

RUN_DIR=runs/local; WORKERS=2; TRAINER_PROCS=1; PORT=5555; STEPS=""; INIT_CKPT=""; TOKENIZER=""
TRAIN_JSONL=""; EVAL_JSONL=""; EXTRA=(); WORKER_ARGS=""; SKIP_EVAL=0; MAX_NEW=8; TEMPLATE=plain
parse_local_flags() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --run_dir=*) RUN_DIR="${1#*=}" ;;
      --workers=*) WORKERS="${1#*=}" ;;
      --trainer_procs=*) TRAINER_PROCS="${1#*=}" ;;
      --port=*) PORT="${1#*=}" ;;
      --steps=*) STEPS="${1#*=}" ;;
      --init_checkpoint=*) INIT_CKPT="${1#*=}" ;;
      --tokenizer=*) TOKENIZER="${1#*=}" ;;
      --train_jsonl=*) TRAIN_JSONL="${1#*=}" ;;
      --eval_jsonl=*) EVAL_JSONL="${1#*=}" ;;
      --worker_args=*) WORKER_ARGS="${1#*=}" ;;
      --max_new_tokens=*) MAX_NEW="${1#*=}" ;;
      --template=*) TEMPLATE="${1#*=}" ;;
      --skip_eval) SKIP_EVAL=1 ;;
      --) shift; EXTRA=("$@"); return ;;
      *) echo "launch.sh local: unknown flag $1 (train.py flags go after --)" >&2; exit 2 ;;
    esac
    shift
  done
}

# Defaults of the built-in demo: one place, so that README numbers come from exactly these settings.
DEMO_TASK_FLAGS=(--task=arithmetic --difficulty=2 --ops=+)
DEMO_SFT_FLAGS=(--sft_steps=500 --sft_batch=64 --sft_lr=3e-3)
DEMO_RL_FLAGS=(--algo=grpo --steps=1600 --prompts_per_step=16 --group_size=8 --lr=3e-4 --dynamic_sampling
                --checkpoint_every=10)
DEMO_EVAL_FLAGS=(--eval_task=arithmetic --eval_difficulty=2 --eval_ops=+ --eval_n=500 --k=8 --temperature=1.0)

declare -A CMDS=() PIDS=() RESTARTS=()
start_role() {  # start_role NAME CMD...: background it, log and pidfile under the run dir
  local name="$1"; shift
  CMDS[$name]="$*"
  "$@" >>"$RUN_DIR/logs/$name.log" 2>&1 &
  PIDS[$name]=$!
  echo "${PIDS[$name]}" >"$RUN_DIR/pids/$name.pid"
}

stop_roles() {  # SIGTERM the given roles, wait up to 30 s for them to checkpoint / drain, then SIGKILL
  local name alive
  for name in "$@"; do kill -TERM "${PIDS[$name]}" 2>/dev/null || true; done
  for _ in $(seq 1 30); do
    alive=0
    for name in "$@"; do kill -0 "${PIDS[$name]}" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1
  done
  for name in "$@"; do kill -KILL "${PIDS[$name]}" 2>/dev/null || true; wait "${PIDS[$name]}" 2>/dev/null || true; done
}

stop_all() {  # clients first, so that draining workers and a checkpointing trainer still reach the server
  local clients=()
  local name
  for name in "${!PIDS[@]}"; do [ "$name" != server ] && clients+=("$name"); done
  [ ${#clients[@]} -gt 0 ] && stop_roles "${clients[@]}"
  [ -n "${PIDS[server]:-}" ] && stop_roles server
  rm -f "$RUN_DIR"/pids/*.pid
}

supervise() {  # restart any child that died until the trainer writes DONE
  local name
  while [ ! -f "$RUN_DIR/DONE" ]; do
    sleep 1
    for name in "${!PIDS[@]}"; do
      if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then
        wait "${PIDS[$name]}" 2>/dev/null && rc=0 || rc=$?
        [ -f "$RUN_DIR/DONE" ] && break 2
        RESTARTS[$name]=$(( ${RESTARTS[$name]:-0} + 1 ))
        if [ "${RESTARTS[$name]}" -gt "${MAX_RESTARTS:-20}" ]; then
          echo "launch.sh: $name died $((RESTARTS[$name])) times, giving up; see $RUN_DIR/logs/$name.log" >&2
          stop_all; exit 1
        fi
        echo "launch.sh: $name exited (rc=$rc); restart #${RESTARTS[$name]}" | tee -a "$RUN_DIR/logs/supervisor.log"
        sleep 2  # a crash loop (bad flag, bad data) should not spin; MAX_RESTARTS ends it
        local group=("$name")
        # The trainer's JAX processes run collectives together: when one dies, restart all of them.
        [[ "$name" == trainer* ]] && group=($(printf '%s\n' "${!PIDS[@]}" | grep '^trainer'))
        local g
        for g in "${group[@]}"; do kill -KILL "${PIDS[$g]}" 2>/dev/null || true; done
        for g in "${group[@]}"; do
          # shellcheck disable=SC2086
          start_role "$g" ${CMDS[$g]}
        done
      fi
    done
  done
}

run_local() {
  parse_local_flags "$@"
  setup_venv requirements.txt
  mkdir -p "$RUN_DIR/logs" "$RUN_DIR/pids"
  export PYTHONUNBUFFERED=1 JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
  local t_start=$SECONDS
  if [ -z "$TOKENIZER" ]; then
    TOKENIZER="$RUN_DIR/tokenizer-arithmetic.model"
    [ -f "$TOKENIZER" ] || echo "== building the task tokenizer: $TOKENIZER"
    "$PY" -c "import data, sys; data.build_task_tokenizer(sys.argv[1], 'arithmetic', seed=0)" "$RUN_DIR" >/dev/null
  fi
  local base="${INIT_CKPT:-$RUN_DIR/base}"
  if [ ! -f "$base/config.json" ]; then
    [ -n "$INIT_CKPT" ] && { echo "no config.json in --init_checkpoint=$INIT_CKPT" >&2; exit 2; }
    echo "== supervised warm-start of the base policy -> $base (log: $RUN_DIR/logs/sft.log)"
    "$PY" train.py --mode=sft --run_dir="$RUN_DIR" --tokenizer="$TOKENIZER" "${DEMO_TASK_FLAGS[@]}" "${DEMO_SFT_FLAGS[@]}" \
      >"$RUN_DIR/logs/sft.log" 2>&1 || { tail -20 "$RUN_DIR/logs/sft.log"; exit 1; }
  fi
  local eval_flags=("${DEMO_EVAL_FLAGS[@]}" --max_new_tokens="$MAX_NEW" --template="$TEMPLATE")
  [ -n "$EVAL_JSONL" ] && eval_flags+=(--eval_jsonl="$EVAL_JSONL")
  if [ $SKIP_EVAL = 0 ] && [ ! -f "$RUN_DIR/eval_before.json" ]; then
    echo "== pass@k of the base policy on held-out problems"
    "$PY" rollout.py --mode=eval --checkpoint="$base" --tokenizer="$TOKENIZER" "${eval_flags[@]}" \
      --out="$RUN_DIR/eval_before.json" 2>>"$RUN_DIR/logs/eval.log"
  fi
  [ -f "$RUN_DIR/token" ] || (umask 077; "$PY" -c "import secrets; print(secrets.token_hex(16))" >"$RUN_DIR/token")

  if [ ! -f "$RUN_DIR/DONE" ]; then
    echo "== RL: server :$PORT, $TRAINER_PROCS trainer process(es), $WORKERS workers (logs: $RUN_DIR/logs)"
    trap 'stop_all; exit 130' INT TERM
    start_role server "$PY" param_server.py --port="$PORT" --token_file="$RUN_DIR/token" --run_dir="$RUN_DIR/server"
    local train=("$PY" train.py --run_dir="$RUN_DIR" --server=127.0.0.1:"$PORT" --token_file="$RUN_DIR/token"
                 --init_checkpoint="$base" --tokenizer="$TOKENIZER" "${DEMO_TASK_FLAGS[@]}" "${DEMO_RL_FLAGS[@]}"
                 --max_new_tokens="$MAX_NEW" --template="$TEMPLATE")
    [ -n "$STEPS" ] && train+=(--steps="$STEPS")
    [ -n "$TRAIN_JSONL" ] && train+=(--train_jsonl="$TRAIN_JSONL")
    local i
    for i in $(seq 0 $((TRAINER_PROCS - 1))); do
      local mp=()
      [ "$TRAINER_PROCS" -gt 1 ] && mp=(--num_processes="$TRAINER_PROCS" --process_id="$i"
                                        --coordinator=127.0.0.1:$((PORT + 1)))
      start_role "trainer$i" "${train[@]}" "${mp[@]}" "${EXTRA[@]}"
    done
    for i in $(seq 0 $((WORKERS - 1))); do
      start_role "worker$i" "$PY" rollout.py --server=127.0.0.1:"$PORT" --token_file="$RUN_DIR/token" \
        --tokenizer="$TOKENIZER" --worker_id="worker$i" --seed="$i" $WORKER_ARGS
    done
    # The trainer's tqdm bar goes to its log; show it here while we supervise. $! must be tail itself (in a
    # plain pipeline it is grep's pid, and killing grep left tail -F running forever, holding our stdout open);
    # --pid ends it with this script even if we are SIGKILLed.
    tail -n 0 -F --pid=$$ "$RUN_DIR/logs/trainer0.log" 2>/dev/null > >(tr '\r' '\n' | grep --line-buffered -E "it/s|s/it") &
    local tail_pid=$!
    supervise
    kill "$tail_pid" 2>/dev/null || true
    stop_all
    trap - INT TERM
  fi
  [ $SKIP_EVAL = 1 ] && { echo "== done (eval skipped): $RUN_DIR/final"; return; }
  echo "== pass@k of the trained policy on the same held-out problems"
  "$PY" rollout.py --mode=eval --checkpoint="$RUN_DIR/final" --tokenizer="$TOKENIZER" "${eval_flags[@]}" \
    --out="$RUN_DIR/eval_after.json" 2>>"$RUN_DIR/logs/eval.log"
  "$PY" - "$RUN_DIR" $((SECONDS - t_start)) <<'EOF'
import json, sys
d, secs = sys.argv[1], int(sys.argv[2])
b, a = (json.load(open(f"{d}/eval_{x}.json")) for x in ("before", "after"))
ks = [k for k in b if k.startswith("pass@")]
print(f"\nheld-out problems: {b['n_problems']}, {b['n_samples']} samples each, temperature {b['temperature']}")
print(f"{'metric':<8} {'before':>8} {'after':>8} {'delta':>8}")
for k in ks:
  print(f"{k:<8} {100 * b[k]:>7.1f}% {100 * a[k]:>7.1f}% {100 * (a[k] - b[k]):>+7.1f}")
print(f"wall time of this launch: {secs // 60} min {secs % 60} s")
EOF
}

stop_local() {
  parse_local_flags "$@"
  local f
  for f in "$RUN_DIR"/pids/*.pid; do [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null || true; done
  sleep "${STOP_GRACE_S:-15}"
  for f in "$RUN_DIR"/pids/*.pid; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done
  echo "stopped $RUN_DIR"
}

# ---------------------------------------------------------------------------------------------------------------
# TPU pods

run_pod() {
  local size="$1"; shift
  local gen="${size%%-*}" chips="${size#*-}" tpu="" infer="" zone="" dry=0 port=5555 extra=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --tpu=*) tpu="${1#*=}" ;; --infer_tpu=*) infer="${1#*=}" ;; --zone=*) zone="${1#*=}" ;;
      --port=*) port="${1#*=}" ;; --dry_run) dry=1 ;; --) shift; extra=("$@"); break ;;
      *) echo "launch.sh $size: unknown flag $1" >&2; exit 2 ;;
    esac
    shift
  done
  [ -n "$tpu" ] && [ -n "$zone" ] || { echo "launch.sh $size needs --tpu=NAME --zone=ZONE" >&2; exit 2; }
  [[ "$chips" =~ ^[0-9]+$ ]] || { echo "bad slice size $size" >&2; exit 2; }
  infer="${infer:-$tpu-infer}"
  # Chips per host: v5p hosts carry 4 chips; v6e-8 and smaller are one host, larger v6e slices 4 chips per host.
  local per_host=4
  [ "$gen" = v6e ] && [ "$chips" -le 8 ] && per_host="$chips"
  local hosts=$(( (chips + per_host - 1) / per_host ))
  local dir="\$HOME/rl" run="\$HOME/rl/runs/pod"
  local ssh="gcloud compute tpus tpu-vm ssh"
  local server_ip="\$($ssh $tpu --zone=$zone --worker=0 --command='hostname -I' | cut -d' ' -f1)"
  local cmds=(
    "$ssh $tpu --zone=$zone --worker=0 --command='cd $dir && mkdir -p $run && (umask 077; [ -f $run/token ] || python3 -c \"import secrets;print(secrets.token_hex(16))\" > $run/token) && nohup python3 param_server.py --host=0.0.0.0 --port=$port --token_file=$run/token --run_dir=$run/server > $run/server.log 2>&1 &'"
    "$ssh $tpu --zone=$zone --worker=all --command='cd $dir && nohup python3 train.py --run_dir=$run --server=$server_ip:$port --token_file=$run/token --num_processes=0 --init_checkpoint=\$HOME/ckpt --tokenizer=\$HOME/ckpt ${extra[*]} > $run/trainer.log 2>&1 &'"
    "$ssh $infer --zone=$zone --worker=all --command='cd $dir && nohup python3 rollout.py --server=$server_ip:$port --token_file=$run/token --tokenizer=\$HOME/ckpt > $run/worker.log 2>&1 &'"
  )
  echo "# $size: $hosts trainer hosts on $tpu ($per_host chips each), $hosts inference hosts on $infer;"
  echo "# copy the repo to $dir, the token file to both slices, and the checkpoint to \$HOME/ckpt on every host first."
  local c
  for c in "${cmds[@]}"; do
    if [ $dry = 1 ]; then echo "$c"; else eval "$c"; fi
  done
}

cmd="${1:-local}"; shift || true
case "$cmd" in
  local) run_local "$@" ;;
  stop) stop_local "$@" ;;
  test)
    setup_venv requirements-dev.txt
    XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu exec "$PY" -m pytest -q tests "$@"
    ;;
  v5p-*|v6e-*) run_pod "$cmd" "$@" ;;
  *) echo "usage: bash launch.sh {local|stop|test|v5p-N|v6e-N} [flags]" >&2; exit 2 ;;
esac
