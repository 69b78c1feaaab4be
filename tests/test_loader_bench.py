"""tools.loader_bench: per-worker throughput of decode, transform and tokenise, and workers needed."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loader_bench_small(capsys, monkeypatch):
    from tools import loader_bench

    monkeypatch.chdir(ROOT)
    result = loader_bench.main(['--config', 'configs/Pretrain.yaml', '--images', '4', '--size', '160x120',
                                '--repeats', '1', '--step-samples-per-s', '1000'])
    assert capsys.readouterr().out.strip().startswith('{')
    rates = result['images_per_s_per_worker']
    assert all(rates[k] > 0 for k in ('decode', 'transform', 'tokenise', 'pipeline'))
    assert rates['pipeline'] <= min(rates['decode'], rates['transform'], rates['tokenise'])
    assert abs(sum(result['share_of_time'].values()) - 1) < 0.01
    assert result['workers_needed'] == -(-1000 // rates['pipeline'])
    assert result['image_res'] == 256 and result['randaugment'] is True
