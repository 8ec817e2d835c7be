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
