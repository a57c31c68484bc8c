"""Full-`max_tokens` reservation: never over-commits, FIFO with head-of-line blocking."""

from __future__ import annotations

from fleetsim.baselines.reservation import MaxTokensReservation


class _Item:
    def __init__(self, name: str, alive: bool = True) -> None:
        self.name = name
        self.alive = alive


def test_admits_in_order_while_the_full_reservation_fits() -> None:
    ledger: MaxTokensReservation[_Item] = MaxTokensReservation(1000)
    a, b, c = _Item("a"), _Item("b"), _Item("c")
    for item, cost in ((a, 600), (b, 500), (c, 100)):
        ledger.offer(item, cost)
    sent: list[str] = []

    def send(item: _Item) -> bool:
        sent.append(item.name)
        return True

    assert ledger.admit(send) == 1
    # b (500) does not fit beside a (600): c (100) would, but waits behind b (FIFO).
    assert sent == ["a"]
    assert ledger.reserved_tokens == 600
    ledger.release(a)
    assert ledger.admit(send) == 2
    assert sent == ["a", "b", "c"]
    assert ledger.reserved_tokens == 600
    assert not ledger.fits_ever(1001)


def test_vanished_and_withdrawn_items_hold_nothing() -> None:
    ledger: MaxTokensReservation[_Item] = MaxTokensReservation(1000)
    gone, kept = _Item("gone", alive=False), _Item("kept")
    ledger.offer(gone, 400)
    ledger.offer(kept, 900)
    assert ledger.admit(lambda i: i.alive) == 1
    assert ledger.reserved_tokens == 900
    assert not ledger.queue
    ledger.discard(kept)
    assert ledger.reserved_tokens == 0
