"""Scenario 8: Ray token authentication (Ray >= 2.5x: ``RAY_AUTH_MODE=token``).

Injected: a one-node cluster on loopback started with ``RAY_AUTH_MODE=token`` and a random
``RAY_AUTH_TOKEN`` (``HOME`` pointed at a scratch directory, so no ``~/.ray/auth_token`` is read
or written), then three clients in fresh processes: one with authentication disabled and no
token, one with a wrong token, one with the right token; and raw gRPC calls to the GCS with no, a wrong and the right
bearer token. Asserted: the raw calls without the right token get ``UNAUTHENTICATED``, the one
with it lists the node; the first two clients are refused (``ray.init`` raises) and run
nothing; the third connects and runs a task. Skipped, with the reason, where the installed Ray has no token mode.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest

from .conftest import REPO, run_child

pytestmark = [pytest.mark.chaos, pytest.mark.ray]

HEAD = """
import sys
from ray.cluster_utils import Cluster
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                  "object_store_memory": 80 << 20})
print("ADDR " + c.address, flush=True)
sys.stdin.read()
c.shutdown()
print("DOWN", flush=True)
"""

CLIENT = """
import ray
try:
    ray.init(address={addr!r}, namespace="chaos-auth", include_dashboard=False,
             log_to_driver=False)
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc)[:400].replace(chr(10), " "), flush=True)
else:
    @ray.remote(num_cpus=0)
    def answer():
        return 42
    print("CONNECTED", ray.get(answer.remote(), timeout=60), flush=True)
    ray.shutdown()
"""


def _has_token_mode() -> str | None:
    try:
        from ray._private.authentication import authentication_token_setup  # noqa: F401
        from ray._raylet import AuthenticationMode  # noqa: F401
    except ImportError as exc:
        return f"the installed Ray has no token authentication ({exc})"
    return None


def _gcs_probe(addr: str, token: str | None) -> str:
    """One raw gRPC call to the GCS (list nodes), with or without a bearer token: the status."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        md = [("authorization", f"Bearer {token}")] if token else []
        try:
            reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=20, metadata=md)
        except grpc.RpcError as exc:
            return exc.code().name
        return f"OK {len(reply.node_info_list)} node"


def test_client_without_the_token_is_refused(tmp_path, figures):
    reason = _has_token_mode()
    if reason:
        pytest.skip(reason)
    token = secrets.token_hex(32)
    home = tmp_path / "home"
    home.mkdir()
    base = {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0"}
    env = {**os.environ, "PYTHONPATH": str(REPO), **base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_AUTH_TOKEN_PATH")
    head = subprocess.Popen([sys.executable, "-c", HEAD], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = head.stdout.readline()
        assert line.startswith("ADDR "), f"head did not start: {line!r}"
        addr = line.split()[1]
        assert addr.startswith("127.0.0.1:"), addr
        results = {name: (_gcs_probe(addr, tok), 0.0) for name, tok in
                   (("grpc_no_token", None), ("grpc_wrong_token", secrets.token_hex(32)),
                    ("grpc_right_token", token))}
        for name, extra in (("no_token", {"RAY_AUTH_MODE": "disabled"}),
                            ("wrong_token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}),
                            ("right_token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})):
            cenv = {**base, **extra}
            if "RAY_AUTH_TOKEN" not in extra:
                cenv["RAY_AUTH_TOKEN"] = ""
            t0 = time.monotonic()
            try:
                r = run_child(CLIENT.format(addr=addr), env=cenv, timeout=150)
                out = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else f"EXIT {r.returncode}"
            except subprocess.TimeoutExpired:
                out = "TIMEOUT"
            results[name] = (out, round(time.monotonic() - t0, 1))
        print(results)
        assert results["grpc_no_token"][0] == results["grpc_wrong_token"][0] == "UNAUTHENTICATED", results
        assert results["grpc_right_token"][0] == "OK 1 node", results
        assert results["right_token"][0] == "CONNECTED 42", results
        # refused: with the same address, only the token differs from the client that connects
        # (a client without token mode reports the server's UNAUTHENTICATED answers as a failed
        # connection; one with a wrong token names authentication)
        for name in ("no_token", "wrong_token"):
            assert results[name][0].startswith("REFUSED"), (name, results)
            assert "CONNECTED" not in results[name][0]
        figures.update(refused=2, connected_with_token=1,
                       **{f"{k}_s": v[1] for k, v in results.items() if not k.startswith("grpc")},
                       **{k: v[0] for k, v in results.items() if k.startswith("grpc")},
                       no_token_error=results["no_token"][0][:120],
                       wrong_token_error=results["wrong_token"][0][:120])
    finally:
        try:
            head.stdin.close()
            head.wait(90)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
