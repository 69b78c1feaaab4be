"""tools.query_noise: the test split's share of a gap's seed variance, against hand-computed values, a
closed form for two seeds and a simulation whose answer is known."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from grit_io import InputFileError
from tools.query_noise import decompose, hits, interaction_variance, main
from tools.runs import run_dir


def test_interaction_variance_by_hand():
    # d (3 queries x 2 seeds): residuals +-0.5 on the first two queries, 0 on the third; 1 / ((3-1)(2-1))
    d = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    assert interaction_variance(d) == pytest.approx(0.5)
    assert math.isnan(interaction_variance(d[:, :1]))


def test_interaction_variance_of_two_seeds_is_half_the_variance_of_their_difference():
    d = np.random.default_rng(0).integers(-1, 2, size=(500, 2)).astype(float)
    assert interaction_variance(d) == pytest.approx(np.var(d[:, 0] - d[:, 1], ddof=1) / 2)


def _hits(text: np.ndarray, image: np.ndarray) -> dict[str, np.ndarray]:
    return {'text': text.astype(float), 'image': image.astype(float)}


def test_no_interaction_means_no_test_split_share():
    """Every seed's per-query differences are one pattern shifted by a seed-wide change: nothing depends on
    which queries the split holds, so a larger split changes nothing."""
    rng = np.random.default_rng(1)
    base_t, base_i = rng.integers(0, 2, 40), rng.integers(0, 2, 80)
    base = [_hits(base_t, base_i)] * 3
    # the arm gains the same queries on every seed: d is one column repeated
    gained = np.maximum(base_t, np.arange(40) < 10)
    arm = [_hits(gained, base_i)] * 3
    r = decompose(base, arm, seed_gaps=[1.0, 3.0, 5.0])
    assert r['test_split_variance'] == pytest.approx(0.0)
    assert r['seed_std'] == pytest.approx(2.0) and r['std_floor'] == pytest.approx(2.0)
    assert r['variance_from_seeds'] == 3
    assert r['gaps'] == pytest.approx([100 * (gained - base_t).mean() / 2] * 3)  # image retrieval: no change


def test_pure_query_noise_is_all_test_split():
    """Each seed's hits are fresh coin flips per query for both arms, no seed-wide effect: all the gap's seed
    variance is the split's, so its share is near 1 and the floor near 0."""
    rng = np.random.default_rng(2)
    seeds, n_t, n_i = 60, 400, 800
    base = [_hits(rng.random(n_t) < 0.6, rng.random(n_i) < 0.5) for _ in range(seeds)]
    arm = [_hits(rng.random(n_t) < 0.6, rng.random(n_i) < 0.5) for _ in range(seeds)]
    r = decompose(base, arm, factors=(4,))
    expected = 100 ** 2 * (2 * 0.24 / n_t + 2 * 0.25 / n_i) / 4  # Bernoulli variances, both arms
    assert r['test_split_variance'] == pytest.approx(expected, rel=0.05)
    assert 0.7 < r['test_split_share'] < 1.3
    assert r['std_with_larger_test']['4'] < 0.7 * r['seed_std']


def test_mismatched_query_counts_are_refused():
    a = _hits(np.ones(4), np.ones(8))
    with pytest.raises(ValueError, match="different numbers of text-retrieval queries"):
        decompose([a, a], [a, _hits(np.ones(5), np.ones(8))])


def _rankings(text_hits: list[int], image_hits: list[int]) -> dict:
    """A rankings_test.json whose first candidates hit where given (queries listed in reverse order)."""
    i2t = [{'image_index': q, 'gt_text_ids': [q], 'text_ids': [q if h else q + 100, q]}
           for q, h in enumerate(text_hits)]
    t2i = [{'text_index': q, 'gt_image_id': q, 'image_ids': [q if h else q + 1, q]}
           for q, h in enumerate(image_hits)]
    return {'split': 'test', 'image_to_text': i2t[::-1], 'text_to_image': t2i[::-1]}


def test_hits_reads_the_first_candidate_in_query_order():
    h = hits(_rankings([1, 0, 1], [0, 1]))
    assert h['text'].tolist() == [1.0, 0.0, 1.0] and h['image'].tolist() == [0.0, 1.0]


def test_main_reads_the_runs_and_names_a_missing_one(tmp_path, capsys):
    runs = {('GRIT-VLP', 1): ([1, 1, 0, 0], [1, 0]), ('GRIT-VLP', 2): ([1, 0, 1, 0], [1, 1]),
            ('B3', 1): ([1, 0, 0, 0], [1, 0]), ('B3', 2): ([1, 0, 1, 1], [0, 1])}
    for (arm, seed), (t, i) in runs.items():
        folder = os.path.join(run_dir(str(tmp_path), arm, seed, 5e-4, 'p=2,m=20' if arm == 'B3' else None),
                              'zeroshot')
        os.makedirs(folder)
        with open(os.path.join(folder, 'rankings_test.json'), 'w') as f:
            json.dump(_rankings(t, i), f)
    out = main(['--compare_dir', str(tmp_path), '--seeds', '1', '2', '--arms', 'GRIT-VLP', 'B3',
                '--lrs', '5e-4', '5e-4', '--output_dir', str(tmp_path / 'report')])
    # seed 1: text -25, image 0 -> -12.5; seed 2: text +25, image -50 -> -12.5
    assert out['noise']['gaps'] == pytest.approx([-12.5, -12.5])
    assert os.path.isfile(tmp_path / 'report' / 'query_noise.md')
    with pytest.raises(InputFileError, match=r"'GRIT-VLP'.*seed 3.*rankings_test.json is missing"):
        main(['--compare_dir', str(tmp_path), '--seeds', '1', '3', '--arms', 'GRIT-VLP', 'B3',
              '--lrs', '5e-4', '5e-4'])
