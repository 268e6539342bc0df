"""What a home counts on its peers for: the most they could lend (admission), and what they
last published as free (when a waiting request may start). An idle cluster must be able to
start every request it admits."""

from infinite_llm.daemon.peers import IDLE_PEER_KEEPS_BLOCKS, PeerDirectory
from infinite_llm.transport.interface import PeerAddress


def test_admission_capacity_is_what_idle_peers_publish_at_most():
    peers = PeerDirectory(own_inst_id=1)
    # Idle peers publish their pool less what they keep: the padding block of CUDA graphs and
    # the block of their own next step (the CPU keeps one less: capacity is then conservative).
    peers.update(2, PeerAddress("a", 1), num_blocks_free=48 - IDLE_PEER_KEEPS_BLOCKS, draining=False, num_blocks_total=48)
    peers.update(3, PeerAddress("b", 1), num_blocks_free=47, draining=False, num_blocks_total=48)
    peers.update(4, PeerAddress("c", 1), num_blocks_free=40, draining=True, num_blocks_total=48)  # left out
    assert peers.num_lendable_capacity() == 46 + 47
    assert peers.num_lendable_capacity() <= peers.num_free_blocks()
    # Busy peers: admission still counts what they could lend once idle; starting waits for it.
    peers.update(2, PeerAddress("a", 1), num_blocks_free=3, draining=False, num_blocks_total=48)
    assert peers.num_lendable_capacity() == 46 + 47 and peers.num_free_blocks() == 3 + 47


def test_a_peer_that_left_the_membership_takes_nothing_until_it_is_listed_again():
    peers = PeerDirectory(own_inst_id=1)
    two = peers.update(2, PeerAddress("a", 1), num_blocks_free=46, draining=False, num_blocks_total=48)
    peers.update(3, PeerAddress("b", 1), num_blocks_free=20, draining=False, num_blocks_total=24)
    # Instance 2 stopped: its record is gone, its last published figure is no room anyone has.
    assert peers.retain_members({1, 3}) == [2]
    assert [p.inst_id for p in peers.creditors()] == [3]
    assert peers.num_free_blocks() == 20 and peers.num_lendable_capacity() == 22
    assert peers.retain_members({1, 3}) == []  # reported once
    # Its engine id still names the segments it may hold.
    assert peers.by_engine(two.engine_id).inst_id == 2 and peers.cluster_id(two.engine_id) == 2
    peers.update(2, PeerAddress("a", 2), num_blocks_free=46, draining=False, num_blocks_total=48)
    assert peers.retain_members({1, 2, 3}) == []
    assert [p.inst_id for p in peers.creditors()] == [2, 3]
