"""Every key a vLLM request makes takes that request's scope (its tenant).

The scan goes over the source that makes keys for a vLLM request (``mmtier/engines/vllm/``,
where both connectors key a request, and the Serve router's keyer ``mmtier/serve/request_keys.py``):
each call that builds a ``ContentKey`` (``content_key``, ``embedding_key``, ``plan_request``,
``fork_keys``) must pass ``tenant=`` as a call of the one helper (``request_scope``, or
``embedding_scope`` / ``KeyScheme.scope``, which call it), or hand on its own ``tenant``
parameter from inside one of those key-building functions (whose callers the scan then checks).
A key made with the server tenant alone (``tenant=self.tenant``), a client's id or nothing fails.
Then ``request_scope`` itself: the request's ``cache_salt`` changes the scope, the server tenant
comes first (a client's salt alone never names a scope), no salt leaves the server tenant.
Pure source and plain objects: no vLLM needed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from mmtier.engines.vllm.keys import embedding_scope, request_scope

ROOT = Path(__file__).resolve().parents[2]
SCANNED = sorted((ROOT / "mmtier" / "engines" / "vllm").glob("*.py")) + [ROOT / "mmtier" / "serve" / "request_keys.py"]
KEY_CALLS = {"content_key", "embedding_key", "plan_request", "fork_keys"}
SCOPE_HELPERS = {"request_scope", "embedding_scope", "scope"}


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def key_calls(path: Path) -> list[tuple[str, int, str | None, ast.Call, ast.FunctionDef | None]]:
    """(file, line, enclosing function name, the call, the enclosing function) of each key call."""
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(node: ast.AST, fn: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            here = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call) and _name(child.func) in KEY_CALLS:
                out.append((path.relative_to(ROOT).as_posix(), child.lineno, fn and fn.name, child, fn))
            visit(child, here)

    visit(tree, None)
    return out


def unscoped(call: ast.Call, fn: ast.FunctionDef | None) -> str | None:
    """Why the call does not take the request's scope; ``None`` when it does."""
    tenant = next((k.value for k in call.keywords if k.arg == "tenant"), None)
    if tenant is None:
        return "no tenant= (the default tenant, whoever sent the request)"
    if isinstance(tenant, ast.Call) and _name(tenant.func) in SCOPE_HELPERS:
        return None
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} if fn is not None else set()
    if isinstance(tenant, ast.Name) and tenant.id in params and fn.name in KEY_CALLS:
        return None                       # handed on by a key-building function: its callers are checked
    return f"tenant={ast.unparse(tenant)} is not the request's scope (request_scope / embedding_scope)"


def test_every_key_a_request_makes_takes_the_requests_scope():
    calls = [c for path in SCANNED for c in key_calls(path)]
    bad = [f"{file}:{line} ({fn}): {why}" for file, line, fn, call, node in calls
           if (why := unscoped(call, node)) is not None]
    assert not bad, "\n".join(bad)
    made_in = {file for file, *_ in calls}
    # not vacuous: the KV plan (plan.py, keys.py), the EC connector and the router's keyer all make keys
    assert {"mmtier/engines/vllm/plan.py", "mmtier/engines/vllm/keys.py", "mmtier/engines/vllm/ec.py",
            "mmtier/serve/request_keys.py"} <= made_in, made_in
    assert len(calls) >= 7, [(f, ln) for f, ln, *_ in calls]


def test_the_scan_catches_a_key_made_under_the_server_tenant_alone():
    src = ("def item_key(self, feature):\n"
           "    return embedding_key(self.cache, feature, modality='v', tenant=self.tenant)\n")
    call = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and _name(n.func) == "embedding_key")
    fn = ast.parse(src).body[0]
    assert "self.tenant" in unscoped(call, fn)


def test_the_scope_is_the_server_tenant_then_the_requests_salt():
    req = lambda salt=None, lora=None: SimpleNamespace(cache_salt=salt, lora_request=lora)
    assert request_scope("serve", req()) == "serve" and request_scope(None, req()) is None
    a, b = request_scope("serve", req("salt-a")), request_scope("serve", req("salt-b"))
    assert len({a, b, request_scope("serve", req())}) == 3
    assert request_scope("other", req("salt-a")) != a            # the server tenant comes first
    lora = SimpleNamespace(lora_name="ad", lora_path="/p")
    assert request_scope("serve", req("salt-a", lora)) != a        # KV: the adapter too
    # encoder outputs: the adapter only where vLLM runs it in the tower (identifier != mm_hash)
    plain = SimpleNamespace(identifier="h", mm_hash="h")
    tower = SimpleNamespace(identifier="ad:h", mm_hash="h")
    assert embedding_scope("serve", req("salt-a", lora), plain) == a
    assert embedding_scope("serve", req("salt-a", lora), tower) == request_scope("serve", req("salt-a", lora))
