"""The control plane's store: where it listens, and how a client that finds no job says so."""

import pytest

from flexpar import control


def _listening_addresses(port):
    """Local addresses in LISTEN state on `port`, from the kernel's socket tables."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.append(address)
    return found


def test_the_store_listens_on_loopback_only_by_default():
    store = control.connect("127.0.0.1", 0, 5.0, server=True)
    addresses = _listening_addresses(store.port)
    assert addresses == ["0100007F"], f"127.0.0.1 only, got {addresses} (00000000 would be every interface)"
    client = control.connect("127.0.0.1", store.port, 5.0)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_port_in_use_is_a_clear_error():
    store = control.connect("127.0.0.1", 0, 5.0, server=True)
    with pytest.raises(ValueError, match="cannot listen on 127.0.0.1:.*choose another --port"):
        control.connect("127.0.0.1", store.port, 5.0, server=True)


def test_a_client_with_no_job_to_reach_gets_one_line():
    with pytest.raises(control.Unreachable) as raised:
        control.connect_client("127.0.0.1", 1, 0.5)
    assert "no flexpar job answers at 127.0.0.1:1" in str(raised.value) and "\n" not in str(raised.value)
