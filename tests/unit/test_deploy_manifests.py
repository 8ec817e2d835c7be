"""The deployment manifests name commands and settings that exist: every `reval` command in
docker-compose.yml and deploy/k8s parses with the real CLI and its config loads; the RayService's
application builder takes its arguments."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from reval.config import ApiConfig, load_config
from rollout.eval_sets import BENCHMARKS
from services.cli_args import build_parser

ROOT = Path(__file__).resolve().parents[2]


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def parse(command: list[str]):
    assert command[0] == "reval", command
    args = build_parser().parse_args(command[1:])
    if getattr(args, "config", None):
        args.config = args.config.replace("/app/configs", str(ROOT / "configs"))
        load_config(args.config, args.overrides, environ={})  # raises on a bad field
    return args


def test_k8s_manifests_are_well_formed():
    kinds = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for d in docs(path):
            assert {"apiVersion", "kind", "metadata"} <= set(d), path
            assert d["metadata"]["name"].startswith("reval"), path
            kinds.append(d["kind"])
    assert {"RayJob", "RayService", "StatefulSet", "Service"} <= set(kinds)


def test_rayjob_entrypoint_is_a_real_launch():
    job = next(d for d in docs(ROOT / "deploy" / "k8s" / "rayjob.yaml") if d["kind"] == "RayJob")
    args = parse(shlex.split(job["spec"]["entrypoint"]))
    assert args.command == "launch"
    cfg = load_config(args.config, args.overrides, environ={})
    assert cfg.buffer.backend == "redis" and cfg.launch.learner_gpus == 1
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(int(g["maxReplicas"]) for g in groups)
    assert gpus >= cfg.learner.world_size + cfg.launch.workers  # room for every actor


def test_rayservice_builds_the_api():
    svc = next(d for d in docs(ROOT / "deploy" / "k8s" / "rayservice-api.yaml"))
    app = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]
    module, _, name = app["import_path"].partition(":")
    assert (module, name) == ("services.api_serve", "app_builder")
    fields = {k: v for k, v in app["args"].items() if k != "replicas"}
    assert ApiConfig(**fields).redis_url == "redis://:${REDIS_PASSWORD}@reval-redis:6379/0"


def test_compose_commands_parse():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in ("api", "learner", "rollout-0", "eval"):
        default = "${REVAL_CONFIG:-r1_distill_qwen_1p5b.toml}"
        raw = compose["services"][name]["command"]
        command = [c.replace(default, "r1_distill_qwen_1p5b.toml") for c in raw]
        args = parse(command)
        assert args.command == {"api": "serve", "learner": "learner", "rollout-0": "rollout",
                                "eval": "eval"}[name]  # fmt: skip
    default = "${REVAL_CONFIG:-r1_distill_qwen_1p5b.toml}"
    ev = parse([c.replace(default, "r1_distill_qwen_1p5b.toml") for c in
                compose["services"]["eval"]["command"]])  # fmt: skip
    assert ev.follow and ev.every == 10  # the paper evaluates every 10 steps
    # The paper's seven (every benchmark with a hub source; not the locally made wordmath).
    assert set(ev.benchmarks.split(",")) == {n for n, spec in BENCHMARKS.items() if spec.hub}
    assert parse(
        [c.replace(default, "r1_distill_qwen_1p5b.toml") for c in
         compose["services"]["learner"]["command"]]
    ).resume_if_any  # a restarted container resumes  # fmt: skip
    # The learner runs one rank per GPU it reserves.
    learner = compose["services"]["learner"]
    gpus = learner["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert learner["environment"]["REVAL__LEARNER__WORLD_SIZE"] == str(len(gpus))


def test_resume_if_any_resumes_only_a_run_with_a_checkpoint(tmp_path):
    from services.cli import has_checkpoint

    cfg = load_config(str(ROOT / "configs" / "demo.toml"), [f"output_dir={tmp_path}"], environ={})
    assert not has_checkpoint(cfg)
    (cfg.run_dir / "checkpoints").mkdir(parents=True)
    assert not has_checkpoint(cfg)  # a directory, but nothing saved in it
    (cfg.run_dir / "checkpoints" / "latest").write_text("step-00000050")
    assert has_checkpoint(cfg)


def test_the_rayservice_takes_the_redis_password_from_its_environment(monkeypatch):
    import services.api_serve as api_serve

    monkeypatch.setattr(api_serve, "ray_app", lambda cfg, replicas: (cfg, replicas))
    monkeypatch.setenv("REDIS_PASSWORD", "from-the-secret")
    svc = next(d for d in docs(ROOT / "deploy" / "k8s" / "rayservice-api.yaml"))
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    cfg, replicas = api_serve.app_builder(args)
    assert cfg.redis_url == "redis://:from-the-secret@reval-redis:6379/0" and replicas == 2


def test_every_k8s_redis_client_has_the_password():
    redis_doc = [
        d for d in docs(ROOT / "deploy" / "k8s" / "redis.yaml") if d["kind"] == "StatefulSet"
    ]
    container = redis_doc[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    names = {e["name"] for e in container["env"]}
    assert {"REDIS_PASSWORD", "REDISCLI_AUTH"} <= names
    config = next(
        d for d in docs(ROOT / "deploy" / "k8s" / "redis.yaml") if d["kind"] == "ConfigMap"
    )
    assert "protected-mode yes" in config["data"]["redis.conf"]
    job = next(d for d in docs(ROOT / "deploy" / "k8s" / "rayjob.yaml") if d["kind"] == "RayJob")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env["REVAL__REDIS__URL"] == "redis://:$(REDIS_PASSWORD)@reval-redis:6379/0"
    assert "redis_url" not in job["spec"]["entrypoint"]  # (a --set would win over the env)


# -- schemas (issue 43): Kubernetes' own (kubernetes-validate, from PyPI) and KubeRay's v1 API ----

K8S_VERSION = "1.37.0"
"""The Kubernetes release whose OpenAPI schemas the manifests are checked against (the newest
kubernetes-validate bundles)."""


def _object(props: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}  # fmt: skip


_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object"}  # (a PodTemplateSpec: Kubernetes' schema checks it, below)
_OBJ, _INT, _STR, _BOOL = {"type": "object"}, {"type": "integer"}, {"type": "string"}, {
    "type": "boolean"}  # fmt: skip
_HEAD = _object({"template": _TEMPLATE, "rayStartParams": _START_PARAMS, "serviceType": _STR,
                 "enableIngress": _BOOL, "headService": _OBJ, "ingressOptions": _OBJ,
                 "labels": _OBJ, "resources": _OBJ}, ("template",))  # fmt: skip
_WORKER = _object({"groupName": _STR, "replicas": _INT, "minReplicas": _INT, "maxReplicas": _INT,
                   "idleTimeoutSeconds": _INT, "rayStartParams": _START_PARAMS,
                   "template": _TEMPLATE, "scaleStrategy": _OBJ, "numOfHosts": _INT,
                   "suspend": _BOOL, "labels": _OBJ, "priority": _INT, "resources": _OBJ},
                  ("groupName", "template"))  # fmt: skip
_CLUSTER = _object({"headGroupSpec": _HEAD, "workerGroupSpecs": {"type": "array", "items": _WORKER},
                    "rayVersion": _STR, "enableInTreeAutoscaling": _BOOL,
                    "autoscalerOptions": _OBJ, "headServiceAnnotations": _OBJ, "suspend": _BOOL,
                    "managedBy": _STR, "gcsFaultToleranceOptions": _OBJ, "authOptions": _OBJ,
                    "tlsOptions": _OBJ, "upgradeStrategy": _OBJ, "networkPolicy": _OBJ,
                    "historyServerOptions": _OBJ}, ("headGroupSpec",))  # fmt: skip
KUBERAY_V1 = {
    "RayJob": _object(
        {
            "entrypoint": _STR,
            "runtimeEnvYAML": _STR,
            "jobId": _STR,
            "shutdownAfterJobFinishes": _BOOL,
            "ttlSecondsAfterFinished": _INT,
            "activeDeadlineSeconds": _INT,
            "backoffLimit": _INT,
            "rayClusterSpec": _CLUSTER,
            "clusterSelector": _OBJ,
            "metadata": _OBJ,
            "submitterPodTemplate": _OBJ,
            "submitterConfig": _OBJ,
            "entrypointNumCpus": {"type": "number"},
            "entrypointNumGpus": {"type": "number"},
            "entrypointResources": _STR,
            "suspend": _BOOL,
            "submissionMode": _STR,
            "managedBy": _STR,
            "deletionStrategy": _OBJ,
            "preRunningDeadlineSeconds": _INT,
        }
    ),
    "RayService": _object(
        {
            "serveConfigV2": _STR,
            "rayClusterConfig": _CLUSTER,
            "serviceUnhealthySecondThreshold": _INT,
            "deploymentUnhealthySecondThreshold": _INT,
            "serveService": _OBJ,
            "upgradeStrategy": _OBJ,
            "excludeHeadPodFromServeSvc": _BOOL,
            "managedBy": _STR,
            "suspend": _BOOL,
            "rayClusterDeletionDelaySeconds": _INT,
        },
        ("rayClusterConfig",),
    ),
}
"""The spec of KubeRay's ``ray.io/v1`` RayJob and RayService as far as these manifests go: every
field of ``RayJobSpec``, ``RayServiceSpec``, ``RayClusterSpec``, ``HeadGroupSpec`` and
``WorkerGroupSpec`` with its type, unknown ones refused (as the API server's strict field
validation does), read off KubeRay's CRDs (ray-operator/config/crd/bases, 2026-11). The pod
templates inside are checked with Kubernetes' own schema."""


def _pod_templates(d: dict) -> list[tuple[str, dict]]:
    spec = d["spec"].get("rayClusterSpec") or d["spec"].get("rayClusterConfig") or {}
    out = [("headGroupSpec", spec["headGroupSpec"]["template"])]
    out += [(f"workerGroupSpecs[{g['groupName']}]", g["template"])
            for g in spec.get("workerGroupSpecs", [])]  # fmt: skip
    return out


def test_k8s_manifests_pass_kubernetes_and_kuberay_schemas():
    import jsonschema
    import kubernetes_validate

    checked = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for d in docs(path):
            if d["apiVersion"] == "ray.io/v1":
                jsonschema.validate(d["spec"], KUBERAY_V1[d["kind"]])
                for where, template in _pod_templates(d):
                    pod = {"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": f"{d['metadata']['name']}-{where}"},
                           "template": template}  # fmt: skip
                    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
            else:
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            checked.append(d["kind"])
    assert {"RayJob", "RayService", "StatefulSet", "Service"} <= set(checked)


def test_the_schemas_refuse_what_the_api_server_would():
    """The checks can fail: a misspelt KubeRay field, a wrong type, a misspelt container field."""
    import jsonschema
    import kubernetes_validate
    import pytest

    (job,) = [d for d in docs(ROOT / "deploy" / "k8s" / "rayjob.yaml") if d["kind"] == "RayJob"]
    for bad in ({"shutdownAfterJobFinish": True}, {"ttlSecondsAfterFinished": "600"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**job["spec"], **bad}, KUBERAY_V1["RayJob"])
    (_, template), *_ = _pod_templates(job)
    container = {**template["spec"]["containers"][0], "imagePullPolicyy": "Always"}
    spec = {**template["spec"], "containers": [container]}
    pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
           "template": {**template, "spec": spec}}  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
