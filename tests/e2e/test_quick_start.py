"""README's quick start, as written: the server, then the same torchrun command on two "nodes".

Everything the test runs comes out of README.md's "Quick start" section, so the test breaks
when README drifts: the server's flags (``--memory --host 127.0.0.1``), ``hello.py`` from
its heredoc, and the torchrun command. Three things are substituted, no more: the server
listens on a free port instead of 29400 (the endpoint follows), ``hello.py`` lives in the
test's tmp dir instead of /tmp, and the launcher is the venv's own console script. Both
nodes must exit 0 (a worker that aborts at exit makes its node exit 1 and leaves the other
in torch's exit barrier for 300 s: the wait here is far shorter) and print their ranks.

README tells users of torch 2.4 and 2.5 to type ``rdzv-torchrun`` instead of ``torchrun``;
the two nodes of the one job use one launcher each (plain torchrun where torch reads entry
points), so both launchers run the quick start together.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import ServerProcess
from torch_feature import READS_ENTRY_POINTS

# The fixtures' class (conftest.py); annotations only.
Cluster = Any

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
README_PORT = "29400"
# Both nodes up, rendezvous, one all_reduce, exit barrier, shutdown: seconds. Far below the 300 s
# a node spends in the exit barrier when the other one's worker aborted.
NODE_TIMEOUT = 120.0


class QuickStart:
    """The quick start's pieces, read from README.md."""

    def __init__(self, readme: str) -> None:
        section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
        blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
        assert len(blocks) >= 2, "the quick start shows the server's shell, then a node's shell"
        server_line = next(line for line in blocks[0].splitlines() if "rdzv-server" in line)
        self.server_argv = shlex.split(server_line.split("&&")[-1])
        assert self.server_argv[0] == "rdzv-server", server_line
        node = blocks[1]
        heredoc = re.search(r"cat > (\S+) <<'(\w+)'\n(.*?)\n\2\n", node, re.DOTALL)
        assert heredoc is not None, "the node's shell writes the training script with a heredoc"
        self.script_path, self.script = heredoc.group(1), heredoc.group(3) + "\n"
        after = node[heredoc.end():].replace("\\\n", " ")
        torchrun_line = next(line for line in after.splitlines() if line.strip().startswith("torchrun "))
        self.torchrun_argv = shlex.split(torchrun_line)

    def torchrun(self, launcher: str, endpoint: str, script: Path) -> list[str]:
        """README's torchrun command with another launcher, endpoint and script path."""
        argv = [launcher, *self.torchrun_argv[1:]]
        expected = f"--rdzv-endpoint=127.0.0.1:{README_PORT}"
        assert expected in argv, f"README's torchrun command should use {expected}: {argv}"
        assert self.script_path in argv, f"README's torchrun command should run {self.script_path}: {argv}"
        return [
            f"--rdzv-endpoint={endpoint}" if a == expected else str(script) if a == self.script_path else a
            for a in argv
        ]

    def world(self) -> tuple[int, int]:
        """(nodes, processes per node) of README's torchrun command."""
        options = dict(a.split("=", 1) for a in self.torchrun_argv if a.startswith("--") and "=" in a)
        return int(options["--nnodes"]), int(options["--nproc-per-node"])


class ReadmeServer(ServerProcess):
    """The server started with README's flags, plus ``--port`` (0: a free one)."""

    def __init__(self, workdir: Path, flags: list[str]) -> None:
        super().__init__(workdir, durable=False)
        self.flags = flags

    def command(self) -> list[str]:
        return [console_script("rdzv-server"), *self.flags, "--port", str(self.port)]


def console_script(name: str) -> str:
    """The console script ``name`` installed beside this interpreter (the venv's own)."""
    path = Path(sys.executable).with_name(name)
    assert path.exists(), f"{name} is not installed beside {sys.executable} (pip install -e .)"
    return str(path)


@pytest.fixture(scope="module")
def quick_start() -> QuickStart:
    return QuickStart((ROOT / "README.md").read_text())


@pytest.fixture
def readme_server(tmp_path: Path, quick_start: QuickStart) -> Iterator[ReadmeServer]:
    srv = ReadmeServer(tmp_path, quick_start.server_argv[1:])
    srv.start()
    yield srv
    srv.close()


def test_the_quick_start_script_ends_its_process_group(quick_start: QuickStart) -> None:
    lines = [line for line in quick_start.script.splitlines() if line.strip()]
    assert "init_process_group" in quick_start.script
    assert lines[-1] == "dist.destroy_process_group()", "hello.py must end its process group"


def test_the_quick_start_runs_as_written_and_both_nodes_exit_0(
    quick_start: QuickStart, readme_server: ReadmeServer, cluster: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "hello.py"
    script.write_text(quick_start.script)
    # README's shells 2 and 3, at the same time: one types torchrun, the other rdzv-torchrun
    # (both rdzv-torchrun where torch reads no entry points).
    launchers = {"shell-2": "torchrun" if READS_ENTRY_POINTS else "rdzv-torchrun", "shell-3": "rdzv-torchrun"}
    nodes = [
        cluster.launch(name, readme_server, quick_start.torchrun(console_script(launcher), readme_server.endpoint, script))
        for name, launcher in launchers.items()
    ]

    codes = cluster.wait_all(NODE_TIMEOUT)

    assert codes == {"shell-2": 0, "shell-3": 0}, "\n".join(f"--- {n.name} ---\n{n.log_tail()}" for n in nodes)
    num_nodes, nproc = quick_start.world()
    world = num_nodes * nproc
    total = float(sum(range(world)))
    # A node's two workers share its output: one's line can land in the middle of the other's.
    printed = {m for n in nodes for m in re.findall(r"rank \d+/\d+ on node \d+: sum=[\d.]+", n.log_text())}
    expected = {f"rank {r}/{world} on node {r // nproc}: sum={total}" for r in range(world)}
    assert printed == expected, "\n".join(f"--- {n.name} ---\n{n.log_tail()}" for n in nodes)
    readme = (ROOT / "README.md").read_text()
    assert f"`rank 0/{world} on node 0: sum={total}`" in readme, "README quotes what the nodes print"
    assert f"`rank {world - 1}/{world} on node {num_nodes - 1}: sum={total}`" in readme
