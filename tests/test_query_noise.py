"""tools.query_noise: the test split's share of a gap's seed variance, against hand-computed values, a
closed form for two seeds and a simulation whose answer is known."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from grit_io import InputFileError
from tools.query_noise import decompose, image_hits, interaction_variance, main, paired_table
from tools.runs import run_dir


def test_interaction_variance_by_hand():
    # d (3 units x 2 seeds): residuals +-0.5 on the first two units, 0 on the third; 1 / ((3-1)(2-1))
    d = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    assert interaction_variance(d) == pytest.approx(0.5)
    assert math.isnan(interaction_variance(d[:, :1]))


def test_interaction_variance_of_two_seeds_is_half_the_variance_of_their_difference():
    d = np.random.default_rng(0).integers(-1, 2, size=(500, 2)).astype(float)
    assert interaction_variance(d) == pytest.approx(np.var(d[:, 0] - d[:, 1], ddof=1) / 2)


def _rankings(text_hits: list[int], caption_hits: list[tuple[int, int]]) -> dict:
    """A rankings_test.json: image q's first text is a match where text_hits[q]; caption k of image i (in
    caption_hits, (i, hit)) ranks its image first where hit. Queries are listed in reverse order."""
    i2t = [{'image_index': q, 'gt_text_ids': [q], 'text_ids': [q if h else q + 100, q]}
           for q, h in enumerate(text_hits)]
    t2i = [{'text_index': k, 'gt_image_id': i, 'image_ids': [i if h else i + 1, i]}
           for k, (i, h) in enumerate(caption_hits)]
    return {'split': 'test', 'image_to_text': i2t[::-1], 'text_to_image': t2i[::-1]}


def test_image_hits_weigh_an_image_and_its_captions_as_mean_r1_does():
    # image 0: text hit, captions hit / miss; image 1: text miss, its one caption hit. Text R@1 1/2, image R@1
    # 2/3: mean R@1 7/12. Image 0: 1/2 + 1 x 2 / (2 x 3); image 1: 0 + 1 x 2 / 6.
    images, values = image_hits(_rankings([1, 0], [(0, 1), (0, 0), (1, 1)]))
    assert images == [0, 1]
    assert values.tolist() == pytest.approx([0.5 + 1 / 3, 1 / 3])
    assert values.mean() == pytest.approx((1 / 2 + 2 / 3) / 2)
    with pytest.raises(ValueError, match='matches image 7, which ranks no texts'):
        image_hits(_rankings([1, 0], [(7, 1)]))


def test_no_interaction_means_no_test_split_share():
    """Every seed's per-image differences are one pattern: nothing depends on which scenes the split holds,
    so more test scenes change nothing; the seed variance is read from the given seed gaps."""
    rng = np.random.default_rng(1)
    base_values = rng.random(40)
    images = list(range(40))
    base = [(images, base_values)] * 3
    arm = [(images, base_values + (np.arange(40) < 10) * 0.1)] * 3
    r = decompose(paired_table(base, arm), seed_gaps=[1.0, 3.0, 5.0])
    assert r['test_split_variance'] == pytest.approx(0.0)
    assert r['seed_std'] == pytest.approx(2.0) and r['std_floor'] == pytest.approx(2.0)
    assert r['variance_from_seeds'] == 3
    assert r['gaps'] == pytest.approx([100 * 10 * 0.1 / 40] * 3)


def test_pure_scene_noise_is_all_test_split():
    """Each seed's hits are fresh coin flips per image and caption for both arms, with no seed-wide effect:
    all of the gap's seed variance is the split's, its share near 1, and little remains with more scenes."""
    rng = np.random.default_rng(2)
    seeds, n, p = 60, 500, 0.6
    images = list(range(n))

    def run() -> tuple[list[int], np.ndarray]:
        # one text query and four captions per image: mean R@1's weights 1/2 and 1/8
        return images, (rng.random(n) < p) / 2 + rng.binomial(4, p, size=n) / 8

    r = decompose(paired_table([run() for _ in range(seeds)], [run() for _ in range(seeds)]), factors=(4,))
    expected = 100 ** 2 * 2 * p * (1 - p) * (1 / 4 + 4 / 64) / n  # both arms' Bernoulli variances
    assert r['test_split_variance'] == pytest.approx(expected, rel=0.05)
    assert 0.7 < r['test_split_share'] < 1.3
    assert r['std_with_more_test']['4'] < 0.7 * r['seed_std']


def test_runs_that_cannot_be_paired_are_refused():
    a = ([0, 1, 2], np.ones(3))
    with pytest.raises(ValueError, match='different test images'):
        paired_table([a, a], [a, ([0, 1, 3], np.ones(3))])
    with pytest.raises(ValueError, match='2 baseline runs against 1'):
        paired_table([a, a], [a])


def _write_runs(root: str, runs: dict) -> None:
    for (arm, seed), (texts, captions) in runs.items():
        folder = os.path.join(run_dir(root, arm, seed, 5e-4, 'p=2,m=20' if arm == 'B3' else None), 'zeroshot')
        os.makedirs(folder)
        with open(os.path.join(folder, 'rankings_test.json'), 'w') as f:
            json.dump(_rankings(texts, captions), f)


def _record(gaps: dict[int, float]) -> dict:
    """A compare record with GRIT-VLP at 60 and B3 at 60 + gap on each seed."""
    return {'selected_lr': {'GRIT-VLP': 0.0005, 'B3': [0.0005, 'p=2,m=20']},
            'sweep': {'GRIT-VLP': {'0.0005': {str(s): {'mean_r1': 60.0} for s in gaps}},
                      'B3': {'0.0005 p=2,m=20': {str(s): {'mean_r1': 60.0 + g} for s, g in gaps.items()}}}}


def test_main_reads_the_runs_checks_the_record_and_names_a_missing_run(tmp_path):
    captions = [(0, 1), (0, 0), (1, 1), (1, 1)]
    runs = {('GRIT-VLP', 1): ([1, 1], captions), ('GRIT-VLP', 2): ([1, 0], captions),
            ('B3', 1): ([1, 0], captions), ('B3', 2): ([1, 0], [(0, 1), (0, 1), (1, 1), (1, 1)])}
    _write_runs(str(tmp_path), runs)
    start = ['--compare_dir', str(tmp_path), '--seeds', '1', '2', '--arms', 'GRIT-VLP', 'B3', '--lrs', '5e-4',
             '5e-4']
    out = main([*start, '--output_dir', str(tmp_path / 'report')])
    # seed 1: text -50, image 0 -> -25; seed 2: text 0, image +25 -> +12.5
    assert out['arms']['B3']['gaps'] == pytest.approx([-25.0, 12.5])
    assert out['arms']['B3']['seed_std'] == pytest.approx(abs(-25.0 - 12.5) / math.sqrt(2))
    assert os.path.isfile(tmp_path / 'report' / 'query_noise.md')
    record = tmp_path / 'compare.json'
    record.write_text(json.dumps(_record({1: -25.0, 2: 12.5, 3: 0.0})))
    out = main([*start, '--record', str(record)])
    assert out['arms']['B3']['variance_from_seeds'] == 3
    assert out['arms']['B3']['seed_variance'] == pytest.approx(np.var([-25.0, 12.5, 0.0], ddof=1))
    record.write_text(json.dumps(_record({1: -20.0, 2: 12.5})))
    with pytest.raises(InputFileError, match=r'seed 1 is -20\.00 there and -25\.00 in the rankings'):
        main([*start, '--record', str(record)])
    with pytest.raises(InputFileError, match=r"'GRIT-VLP'.*seed 3.*rankings_test.json is missing"):
        main(['--compare_dir', str(tmp_path), '--seeds', '1', '3', '--arms', 'GRIT-VLP', 'B3',
              '--lrs', '5e-4', '5e-4'])
