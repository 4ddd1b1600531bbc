"""Scenario 7: tenant isolation, paired, and a salt that only the server side can make.

Injected: tenant B probes tenant A's content (the same media bytes, A's key itself, prefix
chains built on A's key); a client supplies tenant strings crafted to collide with A's salt
(case, whitespace, NUL, field-encoding tricks, A's salt or scope as text) and a second server
with another ``key_secret`` runs the same tenant name. Asserted per probe: B gets no hit (a miss
or ``ForeignKeyError``) while A repeating the same request hits; no request string reproduces
A's key under another secret or name.
"""

from __future__ import annotations

import pytest

from mmtier import ForeignKeyError, TieredKVCache
from mmtier.content import tenant_salt, tenant_scope

from .conftest import SECRET, fingerprint, make_cfg, media, seeded_kv

pytestmark = pytest.mark.chaos

PROBES = 40


def test_tenant_b_never_hits_tenant_a_content_while_a_does(figures):
    a_hits = b_hits = b_refused = 0
    with TieredKVCache(make_cfg(None, device_pages=64)) as cache:
        seq_b = cache.create_sequence("tenant-b")
        for i in range(PROBES):
            ka = cache.content_key("vision", media(i), tenant="tenant-a")
            k, v = seeded_kv(i, 20)
            assert cache.put(ka, k, v)
            # paired: A repeating the request hits; B with the same bytes misses
            a_hits += cache.contains(cache.content_key("vision", media(i), tenant="tenant-a"))
            kb = cache.content_key("vision", media(i), tenant="tenant-b")
            assert kb.digest != ka.digest and kb.scope != ka.scope
            b_hits += cache.contains(kb)
            # B presenting A's key itself (leaked id): refused at attach
            with pytest.raises(ForeignKeyError):
                cache.attach(seq_b, ka)
            b_refused += 1
            # B chaining on A's key as a parent: refused
            with pytest.raises(ForeignKeyError):
                cache.keys.derive(modality="vision", layout=cache.cfg.spec("vision").layout_fields(),
                                  media=b"\0" * 32, tenant_salt=tenant_salt(SECRET, "tenant-b"), parent=ka)
            b_refused += 1
            # A attaching its own content is served exactly
            seq_a = cache.create_sequence("tenant-a")
            cache.attach(seq_a, ka)
            assert fingerprint(*cache.read_group(ka)) == fingerprint(k, v)
            cache.release(seq_a)
        assert cache.sequence(seq_b).length == 0
        cache.release(seq_b)
    assert a_hits == PROBES and b_hits == 0
    figures.update(probes=PROBES, a_repeat_hits=a_hits, b_hits=b_hits, b_refused=b_refused)


CRAFTED_TENANTS = ["tenant-a ", " tenant-a", "Tenant-A", "TENANT-A", "tenant-a\0", "tenant-a\n",
                   "tenant\0a", "tenant-ａ", "tenant-a" + "\u200b", "tenant", "-a",
                   "\0\0\0\0\0\0\0\x06tenantb", tenant_salt(SECRET, "tenant-a").hex(),
                   tenant_scope(tenant_salt(SECRET, "tenant-a")).hex()]


def test_salt_comes_from_the_server_secret_not_the_request(figures):
    server1 = TieredKVCache(make_cfg(None, device_pages=8))
    server2 = TieredKVCache(make_cfg(None, device_pages=8, key_secret="server-2-secret"))
    try:
        ka1 = server1.content_key("vision", media(7), tenant="tenant-a")
        server1.put(ka1, *seeded_kv(7, 20))
        # the same tenant name on another server gives another salt, hence another key
        ka2 = server2.content_key("vision", media(7), tenant="tenant-a")
        assert ka2.digest != ka1.digest and ka2.scope != ka1.scope
        with pytest.raises(ForeignKeyError):                # server 1's key is foreign on 2
            server2.contains(ka1)
        # no crafted request string reproduces tenant A's salt, scope or key on either server
        tried = 0
        for server in (server1, server2):
            for t in CRAFTED_TENANTS:
                k = server.content_key("vision", media(7), tenant=t)
                assert k.digest not in (ka1.digest, ka2.digest) and k.scope not in (ka1.scope, ka2.scope)
                assert not server.contains(k)
                tried += 1
        assert server1.contains(ka1)
        figures.update(crafted_tenant_strings=tried, collisions=0, cross_server_accepts=0)
    finally:
        server1.close()
        server2.close()
