from peagle_ray.plots import acceptance_plot, plot_acceptance, plot_curve, plot_tokens_per_s

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_chart_is_written_as_a_png(tmp_path):
    metrics = {"val/acceptance_length": 1.4, "val/acceptance_pos_1": 0.3, "val/acceptance_pos_2": 0.1}
    by_k = {str(k): {"overall": {"tokens_per_s": 20.0 + k}} for k in (2, 4)}
    results = {
        "target_only": {"overall": {"tokens_per_s": 21.0}},
        "peagle": {"by_k": by_k, "best": {"overall": {"acceptance_per_position": [0.3, 0.1]}}, "recommended_k": 2},
    }
    curve = {"suite": "mt-bench", "curves": {"peagle": [{"train_tokens": 10, "val_acceptance_length": 1.1}]}}
    written = [
        acceptance_plot(metrics, tmp_path / "a.png", "title"),
        plot_tokens_per_s(results, tmp_path / "eval" / "t.png"),  # its folder is made
        plot_acceptance(results, tmp_path / "p.png"),
        plot_curve(curve, tmp_path / "c.png"),
    ]
    for path in written:
        assert path.read_bytes().startswith(PNG), path
