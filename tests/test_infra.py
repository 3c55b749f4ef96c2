"""What the fleet's files promise, read without a cluster: the k8s spot template, the compose
stack, the deployments file and the worker image. The server-side checks are in test_fleet.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_the_k8s_template_asks_for_spot_gpus_and_never_retries_in_place():
    template = json.loads((REPO / "infra" / "k8s-gpu-spot.json").read_text())
    job = template["job_configuration"]["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    variables = template["variables"]["properties"]
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert pod["nodeSelector"] == "{{ node_selector }}" and pod["tolerations"] == "{{ tolerations }}"
    for label in ("cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType",
                  "kubernetes.azure.com/scalesetpriority", "karpenter.sh/capacity-type"):
        assert label in variables["node_selector"]["description"]
    assert {t["key"] for t in variables["tolerations"]["default"]} >= {"cloud.google.com/gke-spot", "nvidia.com/gpu"}
    assert pod["containers"][0]["envFrom"][0]["secretRef"]["name"] == "{{ credentials_secret }}"
    placeholders = set(re.findall(r"{{\s*(\w+)\s*}}", json.dumps(template["job_configuration"])))
    assert placeholders <= set(variables), placeholders - set(variables)


def test_the_compose_stack_has_every_service_and_publishes_on_loopback_only():
    compose = yaml.safe_load((REPO / "infra" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "prefect-server", "mlflow", "minio", "cpu-worker"} <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    mlflow = services["mlflow"]["command"]
    assert "--backend-store-uri postgresql://" in mlflow and "--artifacts-destination s3://" in mlflow
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert (REPO / "infra" / services["postgres"]["volumes"][1].split(":")[0].removeprefix("./")).exists()
    assert services["cpu-worker"]["build"]["dockerfile"] == "infra/worker.Dockerfile"


def test_deployments_share_their_settings_through_anchors():
    config = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in config["deployments"]}
    assert set(by_name) == {"nightly", "backfill", "on-demand", "gpu-spot"}
    nightly, on_demand, worker = by_name["nightly"], by_name["on-demand"], by_name["gpu-spot"]
    # The same object, not an equal copy: written once, under `definitions`.
    assert nightly["work_pool"] is on_demand["work_pool"] is config["definitions"]["work_pools"]["cpu"]
    assert worker["work_pool"]["job_variables"]["env"] is nightly["work_pool"]["job_variables"]["env"]
    assert nightly["parameters"]["spec"]["fleet"]["deployment"] == "tokenmill-shard-worker/gpu-spot"
    assert nightly["schedules"][0]["cron"] and "schedules" not in on_demand
    for deployment in by_name.values():
        module, function = deployment["entrypoint"].split(":")
        assert f"def {function}(" in (REPO / module).read_text()


def test_the_on_demand_deployment_asks_for_input_and_output(monkeypatch):
    """The UI's run form starts from the deployment's stored parameters, and the server validates a
    run's parameters against the flow's schema (what `prefect deploy` stores). No path may default
    to the demo corpus, which a worker image does not have."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    from tokenmill.spec import DEFAULT_INPUT, DEFAULT_OUTPUT, JobSpec

    config = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in config["deployments"]}
    monkeypatch.chdir(REPO)  # as `prefect deploy` loads it
    schema = parameter_schema(load_flow_from_entrypoint(by_name["on-demand"]["entrypoint"])).model_dump(
        exclude_unset=True)
    stored = by_name["on-demand"]["parameters"]
    assert DEFAULT_INPUT not in json.dumps(stored) and DEFAULT_OUTPUT not in json.dumps(stored)
    assert "default" not in schema["definitions"]["PrefectJob"]["properties"]["input"]  # nothing to prefill
    # an edit of the deployment is checked without `required`: the stored values pass
    validate(stored, schema, raise_on_error=True, ignore_required=True)
    for missing, given in (("input", "output"), ("output", "input")):
        with pytest.raises(ValidationError, match=f"'{missing}' is a required property"):
            validate({"spec": {**stored["spec"], given: "s3://corpus/x/"}}, schema, raise_on_error=True)
    # the form's values once both are filled in: a run, and the job the flow gets
    filled = {"spec": {**stored["spec"], "input": "s3://corpus/in/", "output": "s3://corpus/out/"}}
    validate(filled, schema, raise_on_error=True)
    assert JobSpec.model_validate(filled["spec"]).tracking.mlflow_tracking_uri == "http://mlflow:5000"
    validate(by_name["nightly"]["parameters"], schema, raise_on_error=True)
    validate(by_name["backfill"]["parameters"], schema, raise_on_error=True)
    from tokenmill.tasks.job import PrefectJob

    backfill = PrefectJob.model_validate(by_name["backfill"]["parameters"]["spec"])
    assert backfill.model.engine == "openai-server" and backfill.stop_by and by_name["backfill"]["schedules"][0]["cron"]


def test_the_worker_image_copies_what_exists_and_has_both_targets():
    dockerfile = (REPO / "infra" / "worker.Dockerfile").read_text()
    assert re.search(r"^FROM .* AS gpu$", dockerfile, re.M) and re.search(r"^FROM .* AS cpu$", dockerfile, re.M)
    for source in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (REPO / source).exists(), source
    assert "TOKENMILL_CODE_DIR=/opt/tokenmill" in dockerfile
