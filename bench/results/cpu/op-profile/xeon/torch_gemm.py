import time, torch, statistics, sys
shapes = [(2048, 2048, 2048), (16384, 256, 256), (16384, 1024, 256), (16384, 256, 1024), (2560, 16000, 256),
          (4096, 128, 128), (4096, 512, 128), (4096, 256, 256)]
for th in (1, 16):
    torch.set_num_threads(th)
    for m, n, k in shapes:
        x = torch.randn(m, k); w = torch.randn(n, k)
        torch.nn.functional.linear(x, w)
        ts = []
        for _ in range(7):
            s = time.perf_counter(); torch.nn.functional.linear(x, w); ts.append(time.perf_counter() - s)
        print(f"torch threads {th:2d} {m}x{n}x{k}: {2*m*n*k/statistics.median(ts)/1e9:8.1f} GFLOP/s", flush=True)
