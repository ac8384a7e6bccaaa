"""The ring with blocking send/recv only: even ranks send first, odd ranks receive first, so no
two neighbours both wait to send. Works on a contiguous copy and writes the result back."""

import torch
import torch.distributed as dist


def _pass(send_buf, recv_buf, rank, to, frm):
    if rank % 2 == 0:
        dist.send(send_buf, dst=to)
        dist.recv(recv_buf, src=frm)
    else:
        dist.recv(recv_buf, src=frm)
        dist.send(send_buf, dst=to)


def ring_all_reduce(tensor):
    n = dist.get_world_size()
    if n == 1:
        return None
    me = dist.get_rank()
    to, frm = (me + 1) % n, (me - 1) % n
    work = tensor.detach().reshape(-1).clone()
    pieces = list(torch.tensor_split(work, n))

    for i in range(n - 1):
        send_idx = (me - i) % n
        recv_idx = (me - i - 1) % n
        buf = torch.zeros_like(pieces[recv_idx])
        _pass(pieces[send_idx].contiguous(), buf, me, to, frm)
        pieces[recv_idx].add_(buf)

    for i in range(n - 1):
        send_idx = (me - i + 1) % n
        recv_idx = (me - i) % n
        buf = torch.zeros_like(pieces[recv_idx])
        _pass(pieces[send_idx].contiguous(), buf, me, to, frm)
        pieces[recv_idx].copy_(buf)

    tensor.copy_(work.view_as(tensor))
