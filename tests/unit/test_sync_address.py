"""Broadcast weight sync: the address the servers are told to reach the trainer's rank 0 at."""
import socket

from megatron_gspo.rollout.sglang.weight_sync import BroadcastSync, address_towards


def test_local_servers_get_loopback():
    assert address_towards("http://127.0.0.1:30000") == "127.0.0.1"
    assert BroadcastSync(["http://127.0.0.1:30000"]).master_address == "127.0.0.1"


def test_remote_servers_get_an_address_of_this_host_they_can_route_to():
    address = address_towards("http://10.255.0.1:30000")  # the route to another host (no packet sent)
    assert not address.startswith("127.")
    # it is one of this host's addresses: a socket binds to it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
    # and what BroadcastSync tells remote servers by default (it used to be 127.0.0.1)
    assert BroadcastSync(["http://10.255.0.1:30000"], master_port=29999).master_address == address


def test_unresolvable_host_falls_back_to_the_hostname():
    assert address_towards("http://no-such-host.invalid:1") == socket.gethostname()


def test_an_explicit_address_wins():
    sync = BroadcastSync(["http://10.255.0.1:30000"], master_address="10.0.0.7", master_port=29999)
    assert (sync.master_address, sync.master_port) == ("10.0.0.7", 29999)
