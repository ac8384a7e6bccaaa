"""grader.rank.order on a one-rank gloo group in this process: the order of issues, waits and matrix products it
records."""

from __future__ import annotations

import torch
import torch.distributed as dist

from grader.rank import order


def test_issues_waits_and_matmuls_in_the_order_they_happened():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        events: list = []
        products: list = []
        before = (dist.all_reduce, dist.Work.wait, dist.Work.get_future, torch._C.Future.wait)
        with order.watch_issue_and_wait(events) as calls:
            x = torch.ones(4)
            work = dist.all_reduce(x, async_op=True)  # 0: waited for later
            dist.all_reduce(x)  # 1: blocking, waited for at once
            future_work = dist.all_reduce(x, async_op=True)  # 2: waited for through its future
            other = dist.all_reduce(x, async_op=True)  # 3: finished by settle(), unrecorded, then waited for
            calls.settle()
            with order.watch_matmuls(lambda name, args: (products.append(name),
                                                         events.append({"op": "matmul", "what": name}))):
                torch.ones(2, 3, requires_grad=True).matmul(torch.ones(3, 2)).sum().backward()
            work.wait()
            future_work.get_future().wait()
            other.wait()
            work.wait()  # a second wait on the same work is not a new event
        assert [(e["op"], e.get("id"), e.get("blocking", False)) for e in events] == [
            ("all_reduce", 0, False), ("all_reduce", 1, False), ("wait", 1, True), ("all_reduce", 2, False),
            ("all_reduce", 3, False), ("matmul", None, False), ("matmul", None, False), ("wait", 0, False),
            ("wait", 2, False), ("wait", 3, False)]
        assert [e["async_op"] for e in events if e["op"] == "all_reduce"] == [True, False, True, True]
        assert products == ["mm", "mm"]  # forward, and the input's gradient in backward
        assert (dist.all_reduce, dist.Work.wait, dist.Work.get_future, torch._C.Future.wait) == before  # put back
    finally:
        dist.destroy_process_group()
