"""The deploy recipes (deploy/): every rdzv-server they start parses with the real CLI and
serves durably on 29400, and none of them lets the token out.

Each recipe is read the way its own tool reads it (systemd settings, the Containerfile's
instructions, YAML documents, the shell words of the sbatch scripts); nothing runs but
``bash -n`` over the sbatch scripts and their line that makes a job's token file. Shell and systemd variables become ``/ENV/NAME``,
so a test can say where a path comes from (``${CREDENTIALS_DIRECTORY}/token`` is
``/ENV/CREDENTIALS_DIRECTORY/token``); so do Kubernetes' ``$(NAME)`` references, except where a
test makes each pod of a StatefulSet as Kubernetes does and expands them from the pod's own
environment (``$(POD_NAME)`` from the downward API is ``rdzv-0``, ``rdzv-1``, ...).

The token rules every recipe keeps:
- no ``--token`` flag (the server has none: a command line shows in ``ps``) and no
  ``token=`` in a ``--rdzv-conf`` (the same, for torchrun);
- the name ``RDZV_TOKEN`` appears nowhere: it holds the token itself, and an environment
  shows in ``/proc/PID/environ``, unit files, pod specs and job records. Recipes name a
  file (``--token-file``, ``RDZV_TOKEN_FILE``, ``token_file=``) fed by a secret store.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pytest
import yaml

from rdzv_client import ctl, wire
from rdzv_client.client import parse_endpoints
from rdzv_client.credential import CredentialError, read_token_file
from rdzv_server.api.auth import TokenError, read_token
from rdzv_server.cli import parse
from rdzv_server.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# The recipes that start an rdzv-server, and the others (which only run or feed clients).
SERVER_RECIPES = ("rdzv-server.service", "Containerfile", "kubernetes.yaml", "kubernetes-ha.yaml", "slurm.sbatch")
CLIENT_RECIPES = ("kubernetes-secrets.yaml", "kubernetes-train-job.yaml", "slurm-service-host.sbatch")
DOCS = ("README.md", "etcd-test-cluster.sh")  # not recipes: the index, and a local etcd for replica tests


@pytest.fixture(autouse=True)
def _no_rdzv_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads RDZV_* variables: only what a recipe sets may count, not the test runner's."""
    for name in list(os.environ):
        if name.startswith("RDZV_"):
            monkeypatch.delenv(name)


def _expand(word: str) -> str:
    """A shell or systemd word with its variables as /ENV/NAME (command substitutions: /ENV/CMD)."""
    word = re.sub(r"\$\(.*?\)", "/ENV/CMD", word)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: "/ENV/" + (m.group(1) or m.group(2)), word)


def _server_config(recipe: str, args: list[str]) -> ServerConfig:
    try:
        return parse([_expand(a) for a in args])
    except SystemExit as exc:  # argparse's answer to a flag it does not know
        raise AssertionError(f"{recipe}: rdzv-server refuses {args}") from exc


# -- reading each kind of recipe ------------------------------------------------------------


def _unit_settings(text: str) -> list[tuple[str, str, bool]]:
    """A systemd unit's ``Key=value`` settings as (key, value, active); ``#Key=value`` is a
    commented-out alternative (active False). Prose comments (``# ...``) are not settings."""
    found = []
    for line in text.splitlines():
        match = re.match(r"(#?)([A-Z][A-Za-z]*)=(.*)$", line)
        if match:
            found.append((match.group(2), match.group(3).strip(), not match.group(1)))
    return found


def _container_instructions(text: str) -> list[tuple[str, str]]:
    """A Containerfile's (INSTRUCTION, rest) pairs, continuation lines joined."""
    lines = text.replace("\\\n", " ").splitlines()
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line.strip() and not line.startswith("#")
    ]


def _container_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, rest in _container_instructions(text):
        if instruction == "ENV":
            for word in shlex.split(rest):
                name, _, value = word.partition("=")
                env[name] = value
    return env


Doc = dict[str, Any]
POD_TEMPLATES = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def _documents(recipe: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / recipe).read_text()) if doc]


def _pod_spec(doc: Doc) -> Doc | None:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] in POD_TEMPLATES:
        return doc["spec"]["template"]["spec"]
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None


def _containers(recipe: str) -> list[tuple[Doc, Doc, Doc]]:
    """(workload, pod spec, container) for every container of every workload, init containers too."""
    found = []
    for doc in _documents(recipe):
        pod = _pod_spec(doc)
        for container in [] if pod is None else pod.get("initContainers", []) + pod["containers"]:
            found.append((doc, pod, container))
    return found


def _runs_server(container: Doc) -> bool:
    command = container.get("command") or []
    image = container.get("image", "").rsplit("/", 1)[-1].split(":")[0]
    return command[:1] == ["rdzv-server"] or (not command and image == "rdzv-server")


def _the_server() -> tuple[Doc, Doc, Doc, ServerConfig]:
    (doc, pod, container), *more = [found for found in _containers("kubernetes.yaml") if _runs_server(found[2])]
    assert not more, "kubernetes.yaml runs one rdzv-server (replicas need --etcd)"
    return doc, pod, container, _server_config("kubernetes.yaml", container["args"])


def _declared_secrets() -> dict[tuple[str, str], Doc]:
    return {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in _documents("kubernetes-secrets.yaml")}


def _secret_behind(pod: Doc, container: Doc, path: str) -> tuple[str, str] | None:
    """The (Secret, key) whose value the container sees at ``path``; None if no Secret is mounted there."""
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(root) or "subPath" in mount:
            continue
        file = path[len(root) :]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        if "secret" in volume:
            sources = [{"name": volume["secret"]["secretName"], **volume["secret"]}]
        else:
            sources = [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
        for source in sources:
            if "items" not in source:  # every key is a file of its own name
                return source["name"], file
            for item in source["items"]:
                if item["path"] == file:
                    return source["name"], item["key"]
    return None


def _secret_keys(namespace: str, name: str) -> set[str]:
    secret = _declared_secrets().get((namespace, name))
    assert secret is not None, f"kubernetes-secrets.yaml declares no Secret {namespace}/{name}"
    return set(secret.get("stringData", {})) | set(secret.get("data", {}))


def _assert_from_secret(pod: Doc, container: Doc, namespace: str, path: str, what: str) -> tuple[str, str]:
    found = _secret_behind(pod, container, path)
    assert found is not None, f"{what} ({path}) must be a file mounted from a Secret"
    assert found[1] in _secret_keys(namespace, found[0]), (
        f"Secret {namespace}/{found[0]} has no key {found[1]} ({what})"
    )
    return found


def _flags(words: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` words as {--name: value}."""
    flags: dict[str, str] = {}
    for word, after in zip(words, words[1:] + [""]):
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            flags[name] = value if eq or after.startswith("-") else after
    return flags


def _rdzv_conf(flags: dict[str, str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in flags.get("--rdzv-conf", "").split(",") if item)


def _shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell script: continuation lines joined, comments dropped,
    split at ``&``, ``;``, ``|``, ``&&`` and ``||`` words."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        current: list[str] = []
        for word in shlex.split(line, comments=True):
            if word in ("&", ";", "|", "&&", "||"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    return [command for command in commands if command]


# srun's short options that take a value (the next word).
SRUN_VALUE_OPTIONS = {"-w", "-N", "-n", "-c", "-p", "-G", "-x", "-J", "-o", "-e", "-t", "-C"}


def _srun_steps(text: str) -> list[tuple[list[str], list[str]]]:
    """(srun's own options, the program and its arguments) of every srun in a script."""
    steps = []
    for words in _shell_commands(text):
        if words[0] != "srun":
            continue
        i = 1
        while i < len(words) and words[i].startswith("-"):
            i += 2 if words[i] in SRUN_VALUE_OPTIONS else 1
        steps.append((words[1:i], words[i:]))
    return steps


def _sbatch_components(text: str) -> list[list[str]]:
    """The #SBATCH options of each job component (split at ``#SBATCH hetjob``), read as sbatch
    reads them: up to the first line that is neither a comment nor blank."""
    components: list[list[str]] = [[]]
    for line in text.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            words = shlex.split(line[len("#SBATCH") :], comments=True)
            if words == ["hetjob"]:
                components.append([])
            else:
                components[-1].extend(words)
        elif line.strip() and not line.startswith("#"):
            break
    return components


def _server_invocations(recipe: str, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The argument lists of every rdzv-server the recipe starts (commented alternatives of a
    unit included), with the environment the recipe gives it set in ``monkeypatch``."""
    path = DEPLOY / recipe
    text = path.read_text()
    if recipe == "Containerfile":
        forms = dict(_container_instructions(text))
        assert json.loads(forms["ENTRYPOINT"]) == ["rdzv-server"]
        for name, value in _container_env(text).items():
            monkeypatch.setenv(name, value)
        return [json.loads(forms["CMD"])]
    if path.suffix == ".service":
        runs = [shlex.split(value) for key, value, _ in _unit_settings(text) if key == "ExecStart"]
        assert all(Path(words[0]).name == "rdzv-server" for words in runs), "every ExecStart runs rdzv-server"
        return [words[1:] for words in runs]
    if path.suffix == ".yaml":  # Kubernetes' $(NAME) is a variable, not a command substitution
        return [
            [re.sub(r"\$\((\w+)\)", r"${\1}", word) for word in container.get("args", [])]
            for _, _, container in _containers(recipe)
            if _runs_server(container)
        ]
    return [words[words.index("rdzv-server") + 1 :] for words in _shell_commands(text) if "rdzv-server" in words]


# -- every recipe ---------------------------------------------------------------------------


def test_every_deploy_file_is_checked() -> None:
    """A recipe added to deploy/ must be listed here, and so meet the token rules below."""
    assert sorted(p.name for p in DEPLOY.iterdir()) == sorted(SERVER_RECIPES + CLIENT_RECIPES + DOCS)


@pytest.mark.parametrize("recipe", SERVER_RECIPES)
def test_every_server_a_recipe_starts_parses_and_serves_durably_on_29400(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _server_invocations(recipe, monkeypatch)
    assert runs, f"{recipe} starts no rdzv-server"
    for args in runs:
        config = _server_config(recipe, args)
        assert config.port == 29400 and not config.memory, f"{recipe} should serve durably on 29400"
        assert not config.no_auth, f"{recipe} turns auth off"
        assert config.token_file is not None, f"{recipe} should name its token file, not rely on a home directory"


@pytest.mark.parametrize("recipe", SERVER_RECIPES + CLIENT_RECIPES + DOCS)
def test_no_recipe_puts_a_token_on_a_command_line_or_in_an_environment(recipe: str) -> None:
    text = (DEPLOY / recipe).read_text()
    assert not re.search(r"--token(?![-\w])", text), f"{recipe}: there is no --token flag; use --token-file"
    assert not re.search(r"\bRDZV_TOKEN\b", text), f"{recipe}: name a file (RDZV_TOKEN_FILE), never the token"
    for conf in re.findall(r"--rdzv-conf[= ]+\"?([^\s\"]+)", text):
        keys = [item.split("=", 1)[0] for item in conf.split(",")]
        assert "token" not in keys, f"{recipe}: --rdzv-conf token= shows in ps; use token_file="


# -- systemd --------------------------------------------------------------------------------


def test_systemd_hands_the_token_over_as_a_credential_under_credentials_directory() -> None:
    settings = _unit_settings((DEPLOY / "rdzv-server.service").read_text())
    credentials = {v.split(":", 1)[0]: active for k, v, active in settings if k == "LoadCredential"}
    assert credentials.get("token") is True, "LoadCredential=token:/etc/rdzv-server/token must be on"
    runs = [(v, active) for k, v, active in settings if k == "ExecStart"]
    assert [active for _, active in runs].count(True) == 1, (
        "one ExecStart is active, the others are commented alternatives"
    )
    configs = []
    for value, active in runs:
        config = _server_config("rdzv-server.service", shlex.split(value)[1:])
        assert config.token_file == Path("/ENV/CREDENTIALS_DIRECTORY/token")
        for name in re.findall(r"\$\{CREDENTIALS_DIRECTORY\}/([\w.-]+)", value):
            assert name in credentials, f"ExecStart reads the credential {name}, which no LoadCredential= loads"
            assert credentials[name] or not active, f"the active ExecStart reads {name}: its LoadCredential= must be on"
        configs.append(config)
    assert any(c.tls_key == Path("/ENV/CREDENTIALS_DIRECTORY/tls.key") for c in configs), (
        "the TLS alternative reads its key as a credential too"
    )


def test_systemd_unit_is_hardened_and_writes_only_its_state_directory() -> None:
    settings = _unit_settings((DEPLOY / "rdzv-server.service").read_text())
    on = {key: value for key, value, active in settings if active}  # the last one wins, as in systemd
    assert on.get("DynamicUser") == "yes" or on.get("User") not in (None, "root", "0"), "never run as root"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "PrivateDevices": "yes",
        "RestrictSUIDSGID": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert on.get(key) == value, f"rdzv-server.service: {key}={value}"
    # ProtectSystem=strict leaves the state directory the only place the server may write.
    (active_run,) = [v for k, v, active in settings if k == "ExecStart" and active]
    config = _server_config("rdzv-server.service", shlex.split(active_run)[1:])
    assert on.get("StateDirectory") and config.data_dir in (
        Path("/ENV/STATE_DIRECTORY"),
        Path("/var/lib") / on["StateDirectory"],
    ), "--data-dir must be the unit's StateDirectory"


# -- container ------------------------------------------------------------------------------


def _image_uid() -> int:
    users = [
        rest
        for instruction, rest in _container_instructions((DEPLOY / "Containerfile").read_text())
        if instruction == "USER"
    ]
    uid = users[-1].split(":")[0]
    # Kubernetes' runAsNonRoot can only verify a numeric user.
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: a numeric, non-root uid"
    return int(uid)


def test_container_runs_as_a_numeric_non_root_user() -> None:
    uid = _image_uid()
    _, pod, _, _ = _the_server()
    assert pod["securityContext"]["runAsUser"] == uid, "kubernetes.yaml runs the image's own uid"


def test_container_reads_its_token_from_a_mounted_secret_and_keeps_state_in_a_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = (DEPLOY / "Containerfile").read_text()
    token_file = _container_env(text).get("RDZV_TOKEN_FILE", "")
    assert token_file.startswith("/run/secrets/"), "the token is a secret mounted at /run/secrets"
    (args,) = _server_invocations("Containerfile", monkeypatch)
    config = _server_config("Containerfile", args)
    assert config.token_file == Path(token_file)
    volumes = [
        v for instruction, rest in _container_instructions(text) if instruction == "VOLUME" for v in rest.split()
    ]
    assert str(config.data_dir) in volumes, "the state lives in a volume, not in the container's layer"


# -- Kubernetes -----------------------------------------------------------------------------


def _assert_reads_secrets(recipe: str, doc: Doc, pod: Doc, server: Doc, config: ServerConfig) -> None:
    """The server's token files and TLS key are Secrets' files, and it speaks TLS."""
    namespace = doc["metadata"]["namespace"]
    assert config.token_file is not None and config.tls_cert is not None and config.tls_key is not None, (
        f"{recipe}: the server in a cluster uses TLS: the token must not cross the pod network in clear"
    )
    _assert_from_secret(pod, server, namespace, str(config.token_file), "--token-file")
    if config.read_token_file is not None:
        _assert_from_secret(pod, server, namespace, str(config.read_token_file), "--read-token-file")
    for path, key in ((config.tls_cert, "tls.crt"), (config.tls_key, "tls.key")):
        name, found = _assert_from_secret(pod, server, namespace, str(path), f"--tls-{key[4:]}")
        assert found == key and _declared_secrets()[(namespace, name)]["type"] == "kubernetes.io/tls"


def test_kubernetes_server_reads_its_token_and_tls_key_from_secrets() -> None:
    _assert_reads_secrets("kubernetes.yaml", *_the_server())


@pytest.mark.parametrize("recipe", ["kubernetes.yaml", "kubernetes-ha.yaml", "kubernetes-train-job.yaml"])
def test_kubernetes_secret_files_are_readable_by_the_pod_alone(recipe: str) -> None:
    for doc in _documents(recipe):
        pod = _pod_spec(doc)
        if pod is None:
            continue
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                mode = volume["secret"].get("defaultMode", 0o644)
            elif any("secret" in s for s in volume.get("projected", {}).get("sources", [])):
                mode = volume["projected"].get("defaultMode", 0o644)
            else:
                continue
            assert mode & 0o007 == 0, f"{recipe}: volume {volume['name']} is world-readable ({mode:o})"
            # Secret files belong to root: a non-root pod reads them through its fsGroup.
            assert "fsGroup" in pod["securityContext"] and mode & 0o040, f"{recipe}: volume {volume['name']} unreadable"


def _assert_unprivileged(recipe: str, pod: Doc, container: Doc) -> None:
    what = f"{recipe}: {container['name']}"
    assert pod["securityContext"]["runAsNonRoot"] is True, what
    assert pod.get("automountServiceAccountToken") is False, f"{what} never talks to the Kubernetes API"
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False, what
    assert context["capabilities"]["drop"] == ["ALL"], what


def test_kubernetes_server_runs_unprivileged_on_a_read_only_root() -> None:
    _, pod, server, config = _the_server()
    _assert_unprivileged("kubernetes.yaml", pod, server)
    mounts = {m["mountPath"] for m in server["volumeMounts"]}
    assert str(config.data_dir) in mounts, "with a read-only root, the data directory must be a volume"


def _assert_probes(server: Doc, config: ServerConfig) -> None:
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert server["livenessProbe"]["httpGet"]["path"] == "/livez"
    for probe in (server["readinessProbe"]["httpGet"], server["livenessProbe"]["httpGet"]):
        assert probe["port"] == config.port
        assert probe.get("scheme", "HTTP") == ("HTTPS" if config.tls_cert else "HTTP"), (
            "a probe speaks what the server speaks"
        )
    # The kubelet presents no client certificate: mutual TLS would fail httpGet probes.
    assert config.tls_client_ca is None


def test_kubernetes_probes_use_livez_and_readyz_which_need_no_token() -> None:
    _, _, server, config = _the_server()
    _assert_probes(server, config)


# Set by Kubernetes on every namespace (1.22+): nobody can give another namespace this name.
NAMESPACE_LABEL = "kubernetes.io/metadata.name"


def _policies_covering(recipe: str, workload: Doc) -> list[Doc]:
    """The NetworkPolicies of ``recipe`` that select the workload's pods."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return [
        d
        for d in _documents(recipe)
        if d["kind"] == "NetworkPolicy"
        and d["metadata"]["namespace"] == workload["metadata"]["namespace"]
        and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ]


def _admitted_namespaces(recipe: str, workload: Doc, port: int) -> set[str]:
    """The namespaces the NetworkPolicies covering a server admit (asserting nothing else gets in)."""
    policies = _policies_covering(recipe, workload)
    assert policies, f"{recipe}: a NetworkPolicy must select the server's pods"
    admitted: set[str] = set()
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), "an ingress rule with no `from` admits everyone"
            for peer in rule["from"]:
                # No ipBlock, no podSelector: whole namespaces, each named by the label Kubernetes sets.
                selector = peer.get("namespaceSelector", {})
                assert list(peer) == ["namespaceSelector"] and list(selector) == ["matchLabels"], peer
                assert list(selector["matchLabels"]) == [NAMESPACE_LABEL], peer
                admitted.add(selector["matchLabels"][NAMESPACE_LABEL])
            assert [p["port"] for p in rule["ports"]] == [port]
    return admitted


def _server_admits() -> set[str]:
    doc, _, _, config = _the_server()
    return _admitted_namespaces("kubernetes.yaml", doc, config.port)


def test_kubernetes_network_policy_admits_the_training_and_monitoring_namespaces_only() -> None:
    assert _server_admits() == {"training", "monitoring"}


def _agents() -> list[tuple[Doc, Doc, Doc, list[str]]]:
    """(job, pod spec, container, torchrun's words) for every agent of kubernetes-train-job.yaml."""
    found = []
    for job, pod, container in _containers("kubernetes-train-job.yaml"):
        words = container.get("command", []) + container.get("args", [])
        if words[:1] == ["torchrun"]:
            found.append((job, pod, container, words))
    assert found, "kubernetes-train-job.yaml runs no torchrun"
    return found


def _assert_agents_can_reach(admitted: set[str], tls: bool) -> None:
    """Every agent runs where the server's NetworkPolicy admits it, reads its token from a
    Secret's file and, when the server speaks TLS, uses TLS and verifies it against a CA."""
    for job, pod, container, words in _agents():
        namespace = job["metadata"]["namespace"]
        assert namespace in admitted, f"the NetworkPolicy must admit {namespace}"
        flags, env = _flags(words), {e["name"]: e.get("value") for e in container.get("env", [])}
        conf = _rdzv_conf(flags)
        assert flags["--rdzv-backend"] == "rdzv-server"
        token_file = conf.get("token_file") or env.get("RDZV_TOKEN_FILE")
        assert token_file, "the agents name their token file (token_file= or RDZV_TOKEN_FILE)"
        assert _assert_from_secret(pod, container, namespace, token_file, "the agents' token")[1] == "token"
        if tls:
            assert flags["--rdzv-endpoint"].startswith("https://") or conf.get("tls") == "1", "agents must use TLS"
            assert "ca_file" in conf, "agents verify the server against its CA"
            _assert_from_secret(pod, container, namespace, conf["ca_file"], "the CA")


def test_kubernetes_training_pods_dial_the_service_over_tls_with_the_token_from_a_secret() -> None:
    doc, _, _, config = _the_server()
    (service,) = [d for d in _documents("kubernetes.yaml") if d["kind"] == "Service"]
    assert service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    address = (
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{service['spec']['ports'][0]['port']}"
    )
    for _, _, _, words in _agents():
        assert _flags(words)["--rdzv-endpoint"].removeprefix("https://") == address
    _assert_agents_can_reach(_server_admits(), config.tls_cert is not None)


def test_kubernetes_training_pods_pass_no_job_settings_and_the_recipes_policy_covers_their_job() -> None:
    text = (DEPLOY / "kubernetes-train-job.yaml").read_text()
    # The operator's command, in the recipe's comment: set once for every run of the Job.
    [line] = [line for line in text.splitlines() if re.match(r"#\s+rdzvctl .* policy set ", line)]
    words = shlex.split(line.lstrip("# "))
    pattern, settings = _policy_set("kubernetes-train-job.yaml", words[1:])
    assert settings["min_nodes"] < settings["max_nodes"], "elastic, so the survivors of a dead node re-form"
    for job, _, _, words in _agents():
        _assert_no_job_settings("kubernetes-train-job.yaml", words)
        assert job["spec"]["parallelism"] == settings["max_nodes"]
        # Kubernetes expands $(JOB_UID) to the Job's uid: the pattern must cover any uid.
        rdzv_id = _flags(words)["--rdzv-id"].replace("$(JOB_UID)", "1c0a5e9e-3b8e-4d0b-9a3f-6f1d2c4b5a69")
        assert fnmatch.fnmatchcase(rdzv_id, pattern), (rdzv_id, pattern)


def test_kubernetes_committed_secrets_hold_no_usable_token_or_key(tmp_path: Path) -> None:
    """Applied as committed, the Secrets make nothing usable: the server and the clients refuse
    every token placeholder, and no key material is in the repository."""
    held = tmp_path / "value"
    for secret in _documents("kubernetes-secrets.yaml"):
        assert secret["kind"] == "Secret"
        values = dict(secret.get("stringData", {}))
        values.update({k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()})
        for key, value in values.items():
            assert "-----BEGIN" not in value, f"{secret['metadata']['name']}: {key} holds real PEM data"
            if "token" in key:
                held.write_text(value)
                with pytest.raises(TokenError):
                    read_token(held)
                with pytest.raises(CredentialError):
                    read_token_file(held)


# -- Kubernetes: replicas over etcd (kubernetes-ha.yaml) ------------------------------------

HA = "kubernetes-ha.yaml"


class StatefulPod(NamedTuple):
    """One pod of a StatefulSet as Kubernetes makes it."""

    workload: Doc
    pod: Doc  # the pod spec
    container: Doc
    service: Doc  # the headless Service that names it
    name: str  # NAME-ORDINAL
    dns: str  # NAME-ORDINAL.SERVICE.NAMESPACE.svc
    args: list[str]  # after the program, $(VAR) expanded from the container's env


def _program(container: Doc) -> str:
    """What the container runs: its command's file name, else its image's name."""
    command = container.get("command") or [container["image"].rsplit("/", 1)[-1].split(":")[0]]
    return Path(command[0]).name


def _pod_env(container: Doc, pod_name: str, namespace: str) -> dict[str, str]:
    """The container's environment in one pod: plain values and the downward API's name and namespace."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if "value" in var:
            env[var["name"]] = var["value"]
        elif field in fields:
            env[var["name"]] = fields[field]
    return env


def _kubernetes_expand(word: str, env: dict[str, str]) -> str:
    """``$(NAME)`` as Kubernetes expands it in a container's command and args (unknown: kept)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), word)


def _stateful_pods(program: str) -> list[StatefulPod]:
    """Every pod of the one StatefulSet of kubernetes-ha.yaml whose container runs ``program``."""
    (doc, pod, container), *more = [
        found for found in _containers(HA) if found[0]["kind"] == "StatefulSet" and _program(found[2]) == program
    ]
    assert not more, f"{HA}: one StatefulSet runs {program}"
    namespace, service_name = doc["metadata"]["namespace"], doc["spec"]["serviceName"]
    (service,) = [
        d
        for d in _documents(HA)
        if d["kind"] == "Service" and (d["metadata"]["namespace"], d["metadata"]["name"]) == (namespace, service_name)
    ]
    # Headless: NAME-ORDINAL.SERVICE names one pod, not a balanced address.
    assert service["spec"].get("clusterIP") == "None", f"{HA}: Service {service_name} must be headless"
    assert service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    pods = []
    for ordinal in range(doc["spec"]["replicas"]):
        name = f"{doc['metadata']['name']}-{ordinal}"
        env = _pod_env(container, name, namespace)
        words = (container.get("command") or ["(image)"])[1:] + container.get("args", [])
        args = [_kubernetes_expand(word, env) for word in words]
        pods.append(StatefulPod(doc, pod, container, service, name, f"{name}.{service_name}.{namespace}.svc", args))
    return pods


def _replicas() -> list[tuple[StatefulPod, ServerConfig]]:
    replicas = [(run, _server_config(HA, run.args)) for run in _stateful_pods("rdzv-server")]
    assert len(replicas) == 3, f"{HA}: three replicas (one may go, and a leader is still left or elected)"
    return replicas


def _etcd_members() -> list[tuple[StatefulPod, dict[str, str]]]:
    members = [(run, _flags(run.args)) for run in _stateful_pods("etcd")]
    assert len(members) == 3, f"{HA}: three etcd members (one may go, and two are a quorum)"
    return members


def _same_address(url: str, host: str, listen: str) -> bool:
    """Whether ``url`` is ``host`` at the scheme and port of the listen URL ``listen``."""
    named, bound = urlsplit(url), urlsplit(listen)
    return (named.scheme, named.hostname, named.port) == (bound.scheme, host, bound.port)


def test_ha_every_replica_keeps_its_log_in_exactly_the_etcd_members_of_the_same_file() -> None:
    client_urls = []
    for member, flags in _etcd_members():
        advertised = flags["--advertise-client-urls"]
        assert _same_address(advertised, member.dns, flags["--listen-client-urls"]), (
            f"{member.name} advertises {advertised}: its own pod name, where it listens"
        )
        client_urls.append(advertised)
    for replica, config in _replicas():
        assert not config.memory and config.data_dir is None, f"{replica.name}: a replica keeps no local state"
        assert sorted(config.etcd) == sorted(client_urls), f"{replica.name}: --etcd lists every etcd member"


def test_ha_each_replica_advertises_the_name_clients_dial_and_an_id_of_its_own() -> None:
    replicas = _replicas()
    for replica, config in replicas:
        assert config.port in [p["port"] for p in replica.service["spec"]["ports"]]
        assert config.port in [p["containerPort"] for p in replica.container["ports"]]
        scheme = "https" if config.tls_cert is not None else "http"
        # A follower names the leader by this URL; clients follow it only to a host:port they list.
        assert config.advertise_url == f"{scheme}://{replica.dns}:{config.port}", replica.name
        assert config.replica_id == replica.name
    ids = [config.replica_id for _, config in replicas]
    assert len(set(ids)) == len(ids), f"replica ids must differ: {ids}"


def test_ha_etcd_members_bootstrap_from_one_initial_cluster_of_their_peer_urls() -> None:
    members = _etcd_members()
    peers = {}
    for member, flags in members:
        assert flags["--name"] == member.name
        peer = flags["--initial-advertise-peer-urls"]
        assert _same_address(peer, member.dns, flags["--listen-peer-urls"]), f"{member.name} advertises {peer}"
        peers[member.name] = peer
    claims = {claim["metadata"]["name"] for claim in members[0][0].workload["spec"]["volumeClaimTemplates"]}
    for member, flags in members:
        cluster = dict(item.split("=", 1) for item in flags["--initial-cluster"].split(","))
        assert cluster == peers, f"{member.name}: --initial-cluster must name every member at its peer URL"
        assert flags["--initial-cluster-state"] == "new" and flags["--initial-cluster-token"]
        data = Path(flags["--data-dir"])
        assert any(
            m["name"] in claims and data.is_relative_to(m["mountPath"]) for m in member.container["volumeMounts"]
        ), f"{member.name}: --data-dir must be on its volume claim"
    assert len({flags["--initial-cluster-token"] for _, flags in members}) == 1


def test_ha_replicas_read_every_secret_from_secrets_and_speak_tls_as_etcd_does() -> None:
    members = _etcd_members()
    for member, flags in members:
        namespace = member.workload["metadata"]["namespace"]
        for flag in [f for f in flags if f.endswith("-file")]:
            _assert_from_secret(member.pod, member.container, namespace, flags[flag], f"etcd {flag}")
        for prefix, urls in (("--", "--listen-client-urls"), ("--peer-", "--listen-peer-urls")):
            if flags[urls].startswith("https://"):
                assert f"{prefix}cert-file" in flags and f"{prefix}key-file" in flags, f"{member.name}: {urls}"
            if f"{prefix}client-cert-auth" in flags:
                assert f"{prefix}trusted-ca-file" in flags, f"{member.name}: {prefix}client-cert-auth needs a CA"
    tls = {flags["--listen-client-urls"].startswith("https://") for _, flags in members}
    client_certs = {"--client-cert-auth" in flags for _, flags in members}
    assert len(tls) == len(client_certs) == 1, "every etcd member serves its clients alike"
    for replica, config in _replicas():
        _assert_reads_secrets(HA, replica.workload, replica.pod, replica.container, config)
        namespace = replica.workload["metadata"]["namespace"]
        assert {url.startswith("https://") for url in config.etcd} == tls, f"{replica.name}: etcd's scheme"
        if tls == {True}:
            assert config.etcd_ca is not None, f"{replica.name}: --etcd-ca verifies etcd"
        if client_certs == {True}:
            assert config.etcd_cert is not None, f"{replica.name}: etcd wants a client certificate (--etcd-cert)"
        for flag, path in (
            ("--etcd-ca", config.etcd_ca),
            ("--etcd-cert", config.etcd_cert),
            ("--etcd-key", config.etcd_key),
            ("--etcd-token-file", config.etcd_token_file),
        ):
            if path is not None:
                _assert_from_secret(replica.pod, replica.container, namespace, str(path), flag)


def test_ha_probes_ask_readyz_and_livez_of_replicas_and_members() -> None:
    for replica, config in _replicas():
        _assert_probes(replica.container, config)  # /readyz: followers stay ready (their not_leader finds the leader)
    for member, flags in _etcd_members():
        metrics = urlsplit(flags["--listen-metrics-urls"])  # no client certificate needed there
        probes = {kind: member.container[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe")}
        assert probes["readinessProbe"]["path"] == "/readyz" and probes["livenessProbe"]["path"] == "/livez"
        for probe in probes.values():
            assert probe["port"] == metrics.port and probe.get("scheme", "HTTP") == metrics.scheme.upper()


@pytest.mark.parametrize("program", ["rdzv-server", "etcd"])
def test_ha_pods_start_together_on_three_nodes_and_a_drain_takes_one_at_a_time(program: str) -> None:
    first, *_ = _stateful_pods(program)
    spec, namespace = first.workload["spec"], first.workload["metadata"]["namespace"]
    labels = spec["template"]["metadata"]["labels"]
    # etcd is not ready before it has quorum: one pod at a time would wait for ever.
    assert spec["podManagementPolicy"] == "Parallel"
    terms = first.pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        term["topologyKey"] == "kubernetes.io/hostname"
        and term["labelSelector"]["matchLabels"].items() <= labels.items()
        for term in terms
    ), f"{program}: no two pods on one node"
    budgets = [
        d["spec"]
        for d in _documents(HA)
        if d["kind"] == "PodDisruptionBudget"
        and d["metadata"]["namespace"] == namespace
        and d["spec"]["selector"]["matchLabels"]
        and d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert [budget.get("maxUnavailable") for budget in budgets] == [1], f"{program}: one PodDisruptionBudget"


def test_ha_every_container_runs_unprivileged_on_a_read_only_root() -> None:
    for doc, pod, container in _containers(HA):
        _assert_unprivileged(HA, pod, container)
    replica = _replicas()[0][0]
    assert replica.pod["securityContext"]["runAsUser"] == _image_uid(), "the replicas run the image's own uid"


def _egress_ports(workload: Doc, to: Doc) -> set[int] | None:
    """The ports the workload's pods may dial on ``to``'s pods (same namespace); None: any."""
    policies = [d for d in _policies_covering(HA, workload) if "Egress" in d["spec"]["policyTypes"]]
    if not policies:
        return None
    labels = to["spec"]["template"]["metadata"]["labels"]
    return {
        port["port"]
        for policy in policies
        for rule in policy["spec"].get("egress", [])
        if any(
            list(peer) == ["podSelector"] and peer["podSelector"]["matchLabels"].items() <= labels.items()
            for peer in rule.get("to", [])
        )
        for port in rule["ports"]
    }


def test_ha_network_policies_admit_agents_to_the_replicas_and_only_the_replicas_to_etcd() -> None:
    (replica, config), *_ = _replicas()
    (member, flags), *_ = _etcd_members()
    assert _admitted_namespaces(HA, replica.workload, config.port) == {"training", "monitoring"}
    client_port, peer_port = urlsplit(flags["--listen-client-urls"]).port, urlsplit(flags["--listen-peer-urls"]).port
    replica_labels = replica.workload["spec"]["template"]["metadata"]["labels"]
    policies = _policies_covering(HA, member.workload)
    assert policies and all("Ingress" in p["spec"]["policyTypes"] for p in policies)
    admitted = False
    for rule in [rule for policy in policies for rule in policy["spec"].get("ingress", [])]:
        assert rule.get("from"), "an ingress rule with no `from` admits everyone"
        if "ports" in rule and client_port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule["from"]:  # the client port: the replicas' pods, no one else
            selector = peer.get("podSelector", {}).get("matchLabels")
            assert list(peer) == ["podSelector"] and selector and selector.items() <= replica_labels.items(), peer
            admitted = True
    assert admitted, "etcd's NetworkPolicy must admit the replicas"
    replica_egress = _egress_ports(replica.workload, member.workload)
    assert replica_egress is None or client_port in replica_egress, "the replicas must be let out to etcd"
    member_egress = _egress_ports(member.workload, member.workload)
    assert member_egress is None or peer_port in member_egress, "etcd members must be let out to their peers"


def test_ha_training_pods_list_exactly_the_replicas_as_they_advertise_themselves() -> None:
    """kubernetes-train-job.yaml's commented --rdzv-endpoint: every replica, by its --advertise-url."""
    text = (DEPLOY / "kubernetes-train-job.yaml").read_text()
    (spec,) = re.findall(r"^\s*#\s*--rdzv-endpoint=(\S+)\s*$", text, re.MULTILINE)
    listed = [(endpoint.host, endpoint.port) for endpoint in parse_endpoints(spec)]
    replicas = _replicas()
    advertised = [(url.hostname, url.port) for url in (urlsplit(str(c.advertise_url)) for _, c in replicas)]
    assert len(set(listed)) == len(listed) and sorted(listed) == sorted(advertised)
    # The rest of the agents' command serves the replicas unchanged.
    (replica, config), *_ = replicas
    _assert_agents_can_reach(_admitted_namespaces(HA, replica.workload, config.port), config.tls_cert is not None)


# -- Slurm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["slurm.sbatch", "slurm-service-host.sbatch"])
def test_slurm_script_is_valid_bash(recipe: str) -> None:
    subprocess.run(["bash", "-n", str(DEPLOY / recipe)], check=True)


def test_slurm_server_runs_in_its_own_job_component_never_on_a_training_node() -> None:
    text = (DEPLOY / "slurm.sbatch").read_text()
    components = _sbatch_components(text)
    assert len(components) == 2, "a heterogeneous job: component 0 serves, component 1 trains"
    gpus = re.compile(r"--(gpus|gpus-per-\w+|gres=.*gpu)")
    server_options, train_options = components
    assert not any(gpus.match(o) for o in server_options), "the server's component asks for no GPU"
    assert any(gpus.match(o) for o in train_options)
    assert "--no-kill" in train_options, "a dead training node must not end the job"
    steps = _srun_steps(text)
    servers = [options for options, program in steps if program[0] == "rdzv-server"]
    agents = [options for options, program in steps if program[0] == "torchrun"]
    assert servers and agents
    # srun's last --het-group wins.
    assert all(_flags(options).get("--het-group") == "0" for options in servers), "the server runs on component 0"
    assert all(
        _flags(options).get("--het-group") == "1" and _flags(options).get("--nodes") == "1" for options in agents
    ), "one agent step per training node, on component 1"
    assert re.search(
        r'^RDZV_HOST=\$\(scontrol show hostnames "\$SLURM_JOB_NODELIST_HET_GROUP_0"', text, re.MULTILINE
    ), "the agents dial component 0's node"


def test_slurm_service_host_recipe_starts_no_server_and_needs_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (DEPLOY / "slurm-service-host.sbatch").read_text()
    assert _server_invocations("slurm-service-host.sbatch", monkeypatch) == []
    assert '"${RDZV_HOST:?' in text, "without RDZV_HOST the job stops at once"


@pytest.mark.parametrize("recipe", ["slurm.sbatch", "slurm-service-host.sbatch"])
def test_slurm_agents_dial_rdzv_host_and_read_the_token_from_a_file(recipe: str) -> None:
    text = (DEPLOY / recipe).read_text()
    agents = [program for _, program in _srun_steps(text) if program[0] == "torchrun"]
    assert agents
    for words in agents:
        flags = _flags(words)
        assert flags["--rdzv-backend"] == "rdzv-server"
        assert flags["--rdzv-endpoint"] == "$RDZV_HOST:29400"
        assert flags["--rdzv-id"] == "$SLURM_JOB_ID"
        _assert_no_job_settings(recipe, words)
    # srun hands the agents the environment: the path, never the token.
    assert re.search(r'^export RDZV_TOKEN_FILE="\$', text, re.MULTILINE)
    # The job's settings: a policy for the job's id, set before any agent starts, elastic.
    commands = _shell_commands(text)
    [(at, policy)] = [(i, c) for i, c in enumerate(commands) if c[0] == "rdzvctl" and "set" in c]
    assert at < min(i for i, c in enumerate(commands) if c[0] == "srun" and "torchrun" in c)
    pattern, settings = _policy_set(recipe, [w.replace("${#TRAIN_NODES[@]}", "4") for w in policy[1:]])
    assert pattern == "$SLURM_JOB_ID"
    assert settings["min_nodes"] < settings["max_nodes"], "elastic, so the survivors of a dead node re-form"


# The job settings an agent would otherwise give on its command line (README "Job policy").
JOB_SETTING_KEYS = frozenset(wire.POLICY_KEYS)


def _assert_no_job_settings(recipe: str, words: list[str]) -> None:
    """The agent passes none of the job's settings: they are the policy's (the scheduler
    passes the endpoint and the job id; torchrun's own --nproc-per-node and --max-restarts)."""
    flags = _flags(words)
    assert "--nnodes" not in flags, f"{recipe}: --nnodes is the policy's (min_nodes, max_nodes)"
    assert not JOB_SETTING_KEYS & set(_rdzv_conf(flags)), f"{recipe}: the job's settings are the policy's"


def _policy_set(recipe: str, args: list[str]) -> tuple[str, dict[str, object]]:
    """(PATTERN, settings) of an ``rdzvctl ... policy set`` command, read by rdzvctl's parser."""
    try:
        parsed = ctl.build_parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{recipe}: rdzvctl refuses {args}") from exc
    assert (parsed.command, parsed.policy_command) == ("policy", "set"), args
    return parsed.pattern, ctl.parse_policy_settings(parsed.settings)


def test_slurm_job_token_file_is_private_accepted_and_removed_with_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (DEPLOY / "slurm.sbatch").read_text()
    (server,) = _server_invocations("slurm.sbatch", monkeypatch)
    assert _server_config("slurm.sbatch", server).token_file == Path("/ENV/RDZV_TOKEN_FILE")
    (make,) = [line for line in text.splitlines() if '> "$RDZV_TOKEN_FILE"' in line]
    token_file = tmp_path / "job.token"
    # Under a permissive umask: the recipe's own line must make the file private.
    subprocess.run(
        ["bash", "-euc", "umask 022; " + make], env={**os.environ, "RDZV_TOKEN_FILE": str(token_file)}, check=True
    )
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert read_token(token_file) == read_token_file(token_file)
    assert re.search(r"^trap \w+ EXIT$", text, re.MULTILINE) and 'rm -f "$RDZV_TOKEN_FILE"' in text, (
        "the job's token file goes with the job"
    )
