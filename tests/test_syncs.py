"""The host-device sync counter (tools/syncs.py): what a GPU would wait for, counted on the CPU."""

import torch

from specviz.tools.syncs import SyncCounter


def test_each_kind_of_wait_is_counted_and_device_side_work_is_not():
    x = torch.arange(6.0)
    with SyncCounter() as syncs:
        y = (x * 2 + 1).softmax(-1)[torch.tensor([0, 2])]  # maths and integer indexing: queued, no wait
        torch.zeros(3, device=x.device)
        torch.as_tensor(x)  # a tensor from a tensor: no host data
        y.argmax(-1)
        assert syncs.total == 0
        x.tolist()
        x[1].item()
        bool(x[2] > 1)
        int(x[3])
        float(x[4])
        range(x[0].long())
        x.nonzero()
        torch.where(x > 2)
        x[x > 3]
        x[x > 4] = 0
        torch.tensor([1, 2], device=x.device)
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long))
        if x.sum() > 0:  # the branch reads the comparison back
            pass
    assert dict(syncs.counts) == {"tolist": 1, "item": 1, "bool": 2, "int": 1, "float": 1, "index": 1, "nonzero": 2,
                                  "boolean index": 2, "tensor(list)": 1, "repeat_interleave": 1}
    assert syncs.total == 13
