"""The engine's direct CUDA runtime calls (runtime/cudacalls.py) against
torch's: same bytes moved, same ordering by events. CUDA only."""
import pytest
import torch

from fle_engine.runtime import cudacalls

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=["direct", "torch"])
def calls(request, monkeypatch):
    dev = torch.device("cuda")
    if request.param == "torch":
        monkeypatch.setenv("FLE_CUDA_CALLS", "torch")
        c = cudacalls.pick(dev)
        assert isinstance(c, cudacalls.Torch)
    else:
        monkeypatch.delenv("FLE_CUDA_CALLS", raising=False)
        c = cudacalls.pick(dev)
        # torch's wheels map libcudart: the engine should not fall back to torch's calls there
        assert isinstance(c, cudacalls.Direct), "libcudart not found in this process's maps"
    return c


def test_copies_both_ways_and_on_a_side_stream(calls):
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    host = torch.arange(1 << 20, dtype=torch.int32).pin_memory()
    dev = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    back = torch.zeros_like(host).pin_memory()
    ev, done = calls.event(), calls.event()
    calls.copy(dev, host, main)
    calls.record(ev, main)
    calls.wait(side, ev)                    # the side stream reads what the main stream wrote
    with torch.cuda.stream(side):
        dev.mul_(3)
    calls.record(done, side)
    calls.wait(main, done)
    calls.copy(back, dev, main)
    calls.record(ev, main)                  # an event recorded again after its first use
    calls.synchronize(ev)
    assert torch.equal(back, host * 3)


def test_rows_of_a_larger_buffer(calls):
    main = torch.cuda.current_stream()
    slots = torch.zeros(8, 4096, dtype=torch.uint8, device="cuda")
    host = torch.randint(0, 256, (16, 4096), dtype=torch.uint8).pin_memory()
    for s, e in ((0, 5), (3, 15), (7, 0)):
        calls.copy(slots[s], host[e], main)
    torch.cuda.synchronize()
    assert torch.equal(slots[3].cpu(), host[15]) and torch.equal(slots[0].cpu(), host[5])
    assert int(slots[1].sum()) == 0


def test_direct_refuses_mismatched_sizes():
    c = cudacalls.pick(torch.device("cuda"))
    if not isinstance(c, cudacalls.Direct):
        pytest.skip("torch's calls in use")
    a = torch.zeros(4, device="cuda")
    b = torch.zeros(5).pin_memory()
    with pytest.raises(ValueError):
        c.copy(a, b, torch.cuda.current_stream())
