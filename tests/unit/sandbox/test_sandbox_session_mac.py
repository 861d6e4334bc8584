"""The MAC that makes a session interpreter's answer its loop's: SipHash-2-4, computed by the C loop
(``_zygote.siphash24``) and checked by the fork server (``wire.siphash24``); both must be the
published function, and the same."""

from __future__ import annotations

import importlib.util
import os

import pytest

from arl_tangram.sandbox import wire

KEY = bytes(range(16))


def test_siphash24_gives_the_published_vectors() -> None:
    # From the SipHash paper's reference implementation (vectors.h): key 00..0f, message 00..(n-1).
    assert wire.siphash24(KEY, b"") == 0x726FDB47DD0E0E31
    assert wire.siphash24(KEY, bytes(range(15))) == 0xA129CA6149BE45E5
    assert wire.siphash24(KEY, bytes(range(8))) == 0x93F5F5799A932462


@pytest.mark.skipif(
    importlib.util.find_spec("arl_tangram.sandbox._zygote") is None, reason="the C module is not built"
)
def test_the_c_loop_and_the_fork_server_compute_the_same_mac() -> None:
    from arl_tangram.sandbox import _zygote

    for n in range(40):
        key, data = os.urandom(16), os.urandom(n)
        assert _zygote.siphash24(key, data) == wire.siphash24(key, data), n
    with pytest.raises(ValueError, match="16 bytes"):
        _zygote.siphash24(b"short", b"")


def test_an_answer_is_bound_to_its_key_nonce_and_status() -> None:
    mac = wire.session_mac(KEY, 12345, 1)
    assert mac != wire.session_mac(KEY, 12345, 0)
    assert mac != wire.session_mac(KEY, 12346, 1)
    assert mac != wire.session_mac(bytes(16), 12345, 1)
