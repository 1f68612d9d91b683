#!/usr/bin/env bash
# Run an mha-jax command on every worker of a Cloud TPU VM (single- or multi-host).
#
#   scripts/launch_tpu_vm.sh --name my-tpu --zone us-central2-b [--create --type v4-32] \
#       [--workers N] [--port P] [--dry-run] -- mha-jax train --config configs/translation.py --workdir gs://BUCKET/run
#
# Steps: (optionally) create the TPU VM, copy the repository's tracked files to every
# worker, `pip install -e .[tpu,gcs]` there, then run the command on all workers at once.
# Without --workers, `mha-jax train` gets --multihost (one ssh --worker=all; JAX finds
# the slice itself). With --workers N, worker i runs the command with explicit
# --coordinator WORKER0_IP:P --num-processes N --process-id i, worker 0's internal IP
# read from `gcloud ... describe`. Each host calls jax.distributed.initialize() and
# feeds its own rows of every batch.
# --dry-run prints the gcloud commands instead of running them.
set -euo pipefail

name="" zone="" type="v4-8" version="tpu-ubuntu2204-base" create=0 dry=0 remote_dir="mha-jax"
workers=0 port=8476
usage() { sed -n '2,15p' "$0"; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --create) create=1; shift ;;
    --dry-run) dry=1; shift ;;
    --remote-dir) remote_dir="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "launch_tpu_vm.sh: unknown option $1" >&2; usage ;;
  esac
done
[ -n "$name" ] || { echo "launch_tpu_vm.sh: --name is required" >&2; exit 2; }
[ -n "$zone" ] || { echo "launch_tpu_vm.sh: --zone is required" >&2; exit 2; }
[ $# -gt 0 ] || { echo "launch_tpu_vm.sh: give the command to run after --" >&2; exit 2; }
[[ "$workers" =~ ^[0-9]+$ ]] || { echo "launch_tpu_vm.sh: --workers must be a number; got $workers" >&2; exit 2; }
[[ "$port" =~ ^[0-9]+$ ]] || { echo "launch_tpu_vm.sh: --port must be a number; got $port" >&2; exit 2; }

cmd=("$@")
is_train=0
if [ "${cmd[0]}" = "mha-jax" ] && [ "${cmd[1]:-}" = "train" ]; then is_train=1; fi
if [ "$is_train" = 1 ] && [ "$workers" = 0 ]; then
  case " ${cmd[*]} " in *" --multihost "*) ;; *) cmd+=("--multihost") ;; esac
fi
remote_cmd=$(printf '%q ' "${cmd[@]}")

run() {
  if [ "$dry" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

repo=$(cd "$(dirname "$0")/.." && pwd)
tarball=$(mktemp -u /tmp/mha-jax-XXXXXX).tar.gz
if [ "$dry" = 1 ]; then
  echo "# tar the tracked files of $repo into $tarball"
else
  (cd "$repo" && git ls-files -z | tar --null -czf "$tarball" -T -)
fi

if [ "$create" = 1 ]; then
  run gcloud compute tpus tpu-vm create "$name" --zone "$zone" --accelerator-type "$type" \
    --version "$version"
fi
run gcloud compute tpus tpu-vm scp "$tarball" "$name:~/mha-jax.tar.gz" --zone "$zone" --worker=all
run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command \
  "mkdir -p ~/$remote_dir && tar -xzf ~/mha-jax.tar.gz -C ~/$remote_dir && cd ~/$remote_dir && python3 -m pip install -q -e '.[tpu,gcs]'"
if [ "$is_train" = 1 ] && [ "$workers" -gt 0 ]; then
  if [ "$dry" = 1 ]; then
    run gcloud compute tpus tpu-vm describe "$name" --zone "$zone" \
      --format='value(networkEndpoints[0].ipAddress)'
    coord_ip=WORKER0_IP   # placeholder: the describe command above prints it
  else
    coord_ip=$(gcloud compute tpus tpu-vm describe "$name" --zone "$zone" \
      --format='value(networkEndpoints[0].ipAddress)')
  fi
  pids=()
  for ((i = 0; i < workers; i++)); do
    flags=$(printf '%q ' --coordinator "$coord_ip:$port" --num-processes "$workers" --process-id "$i")
    if [ "$dry" = 1 ]; then
      run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker="$i" --command \
        "cd ~/$remote_dir && PATH=\$HOME/.local/bin:\$PATH $remote_cmd$flags"
    else
      run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker="$i" --command \
        "cd ~/$remote_dir && PATH=\$HOME/.local/bin:\$PATH $remote_cmd$flags" &
      pids+=($!)
    fi
  done
  for p in "${pids[@]}"; do wait "$p"; done
else
  run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command \
    "cd ~/$remote_dir && PATH=\$HOME/.local/bin:\$PATH $remote_cmd"
fi
[ "$dry" = 1 ] || rm -f "$tarball"
