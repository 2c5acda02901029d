"""utils.ring_model: the α–β–γ timeline of a plain and a pipelined ring all-reduce."""
import pytest

from utils.ring_model import finish, ring_timeline

ALPHA, BETA, GAMMA = 10e-6, 1 / 25e9, 1 / 50e9


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_one_piece_is_the_plain_ring_formula(n):
    M = 64e6
    chunk = M / n
    expected = 2 * (n - 1) * (ALPHA + chunk * BETA) + (n - 1) * chunk * GAMMA
    assert finish(ring_timeline(n, M, 1, ALPHA, BETA, GAMMA)) == pytest.approx(expected)


@pytest.mark.parametrize("n, pieces", [(2, 2), (4, 4), (4, 16), (8, 3)])
def test_pipelined_ring_hides_every_add_when_adding_is_no_slower_than_sending(n, pieces):
    M = 64e6
    piece = M / n / pieces
    assert piece * GAMMA <= ALPHA + piece * BETA
    expected = 2 * (n - 1) * pieces * (ALPHA + piece * BETA)       # the link never waits
    assert finish(ring_timeline(n, M, pieces, ALPHA, BETA, GAMMA)) == pytest.approx(expected)


def test_every_rank_sends_two_n_minus_one_chunks_and_adds_n_minus_one():
    n, M, pieces = 4, 8e6, 5
    timeline = ring_timeline(n, M, pieces, ALPHA, BETA, GAMMA)
    sends = [i for i in timeline if i.kind == "send"]
    adds = [i for i in timeline if i.kind == "add"]
    assert len(sends) == 2 * (n - 1) * pieces and len(adds) == (n - 1) * pieces
    assert sum(i.end - i.start for i in sends) == pytest.approx(2 * (n - 1) * (pieces * ALPHA + M / n * BETA))
    assert [i.start for i in timeline] == sorted(i.start for i in timeline)


def test_a_piece_moves_on_only_after_it_arrived_and_was_added():
    timeline = ring_timeline(3, 3e6, 2, ALPHA, BETA, 10 * BETA)        # slow adds: the link waits for them
    sends = {(i.step, i.piece): i for i in timeline if i.kind == "send"}
    adds = {(i.step, i.piece): i for i in timeline if i.kind == "add"}
    for (step, piece), send in sends.items():
        if step == 0:
            continue
        before = adds.get((step - 1, piece)) or sends[step - 1, piece]
        assert send.start >= before.end


def test_pipelining_saves_at_most_the_adds_and_nothing_without_them():
    n, M = 4, 64e6
    plain = finish(ring_timeline(n, M, 1, ALPHA, BETA, GAMMA))
    adds = (n - 1) * M / n * GAMMA
    for pieces in (2, 4, 16, 256):
        assert finish(ring_timeline(n, M, pieces, ALPHA, BETA, GAMMA)) >= plain - adds - 1e-12
        assert finish(ring_timeline(n, M, pieces, ALPHA, BETA, 0.0)) >= finish(ring_timeline(n, M, 1, ALPHA, BETA, 0.0))


def test_too_many_pieces_cost_more_latency_than_they_hide():
    n, M = 4, 1e6
    times = [finish(ring_timeline(n, M, k, ALPHA, BETA, GAMMA)) for k in (1, 2, 4, 64, 1024)]
    assert times[-1] > times[0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        ring_timeline(1, 1e6, 1, ALPHA, BETA, GAMMA)
    with pytest.raises(ValueError):
        ring_timeline(4, 1e6, 0, ALPHA, BETA, GAMMA)
