#!/usr/bin/env bash
# Installs what `python -m bench` needs beyond the project itself: a real etcd (Debian's
# etcd-server 3.4, which still serves the v2 API with --enable-v2) for torch's etcd-v2
# backend, python-etcd (the client torch's etcd-v2 backend imports), matplotlib, psutil.
# Idempotent: each step runs only when its piece is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

if ! command -v etcd >/dev/null 2>&1; then
    apt-get update
    apt-get install -y etcd-server
fi
python -c "import etcd" 2>/dev/null || pip install python-etcd
python -c "import matplotlib, psutil" 2>/dev/null || pip install "matplotlib>=3.7" "psutil>=5.9"
echo "bench setup: etcd $(etcd --version 2>/dev/null | head -1 | awk '{print $NF}'), python-etcd, matplotlib, psutil ready"
