#!/usr/bin/env bash
# Run an mha-jax command on every worker of a Cloud TPU VM (single- or multi-host).
#
#   scripts/launch_tpu_vm.sh --name my-tpu --zone us-central2-b [--create --type v4-32] \
#       [--dry-run] -- mha-jax train --config configs/translation.py --workdir gs-or-local-dir
#
# Steps: (optionally) create the TPU VM, copy the repository's tracked files to every
# worker, `pip install -e .[tpu]` there, then run the command on all workers at once
# (gcloud ... ssh --worker=all). `mha-jax train` gets --multihost, so each host calls
# jax.distributed.initialize() and feeds its own rows of every batch.
# --dry-run prints the gcloud commands instead of running them.
set -euo pipefail

name="" zone="" type="v4-8" version="tpu-ubuntu2204-base" create=0 dry=0 remote_dir="mha-jax"
usage() { sed -n '2,12p' "$0"; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --create) create=1; shift ;;
    --dry-run) dry=1; shift ;;
    --remote-dir) remote_dir="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "launch_tpu_vm.sh: unknown option $1" >&2; usage ;;
  esac
done
[ -n "$name" ] || { echo "launch_tpu_vm.sh: --name is required" >&2; exit 2; }
[ -n "$zone" ] || { echo "launch_tpu_vm.sh: --zone is required" >&2; exit 2; }
[ $# -gt 0 ] || { echo "launch_tpu_vm.sh: give the command to run after --" >&2; exit 2; }

cmd=("$@")
if [ "${cmd[0]}" = "mha-jax" ] && [ "${cmd[1]:-}" = "train" ]; then
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
  "mkdir -p ~/$remote_dir && tar -xzf ~/mha-jax.tar.gz -C ~/$remote_dir && cd ~/$remote_dir && python3 -m pip install -q -e '.[tpu]'"
run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command \
  "cd ~/$remote_dir && PATH=\$HOME/.local/bin:\$PATH $remote_cmd"
[ "$dry" = 1 ] || rm -f "$tarball"
