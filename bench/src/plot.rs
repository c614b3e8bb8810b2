//! The picture of a comparison (SVG, no system fonts needed): TTFT CDF per router,
//! hit rate against the theoretical maximum, and requests per pod.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::experiment::RunResult;

const COLORS: [RGBColor; 7] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// Writes the three-panel SVG of `results` (one workload) to `path`.
pub fn plot(path: &Path, title: &str, results: &[RunResult]) -> Result<()> {
    let results: Vec<&RunResult> = results.iter().filter(|r| r.skipped.is_none()).collect();
    let root = SVGBackend::new(path, (1500, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| anyhow!("{e}"))?;
    let panels = root.split_evenly((1, 3));
    ttft_cdf(&panels[0], &results).map_err(|e| anyhow!("TTFT panel: {e}"))?;
    hit_rates(&panels[1], &results).map_err(|e| anyhow!("hit panel: {e}"))?;
    per_pod(&panels[2], &results).map_err(|e| anyhow!("pod panel: {e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type PlotResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn ttft_cdf(area: &Area<'_>, results: &[&RunResult]) -> PlotResult {
    let max_x = results.iter().map(|r| r.ttft_ms.p99).fold(1.0f64, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption("TTFT CDF (simulated ms)", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..max_x, 0f64..1.0f64)?;
    chart
        .configure_mesh()
        .x_desc("TTFT ms")
        .y_desc("fraction")
        .draw()?;
    for (i, r) in results.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(
                r.ttft_cdf.iter().map(|&(x, y)| (x.min(max_x), y)),
                c.stroke_width(2),
            ))?
            .label(r.router.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn hit_rates(area: &Area<'_>, results: &[&RunResult]) -> PlotResult {
    let n = results.len().max(1);
    let names: Vec<String> = results.iter().map(|r| short(&r.router)).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(
            "prefix-cache hit rate vs theoretical max (dashed)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..n as f64, 0f64..100f64)?;
    chart
        .configure_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| names.get(x.floor() as usize).cloned().unwrap_or_default())
        .y_desc("% of prompt tokens")
        .disable_x_mesh()
        .draw()?;
    for (i, r) in results.iter().enumerate() {
        let x = i as f64;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.15, 0.0), (x + 0.85, r.hit_rate * 100.0)],
            color(i).filled(),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{:.0}%", r.hit_rate * 100.0),
            (x + 0.25, r.hit_rate * 100.0 + 4.0),
            ("sans-serif", 13),
        )))?;
        chart.draw_series(DashedLineSeries::new(
            vec![
                (x + 0.05, r.theoretical_max * 100.0),
                (x + 0.95, r.theoretical_max * 100.0),
            ],
            4,
            3,
            BLACK.stroke_width(2),
        ))?;
    }
    Ok(())
}

fn per_pod(area: &Area<'_>, results: &[&RunResult]) -> PlotResult {
    let n = results.len().max(1);
    let pods = results
        .iter()
        .map(|r| r.per_pod_requests.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let max_y = results
        .iter()
        .flat_map(|r| r.per_pod_requests.iter().copied())
        .max()
        .unwrap_or(1) as f64
        * 1.15;
    let names: Vec<String> = results.iter().map(|r| short(&r.router)).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(
            "requests per pod (imbalance = max/mean)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..n as f64, 0f64..max_y.max(1.0))?;
    chart
        .configure_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| names.get(x.floor() as usize).cloned().unwrap_or_default())
        .y_desc("requests")
        .disable_x_mesh()
        .draw()?;
    for (i, r) in results.iter().enumerate() {
        let w = 0.8 / pods as f64;
        for (p, &count) in r.per_pod_requests.iter().enumerate() {
            let x0 = i as f64 + 0.1 + p as f64 * w;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x0, 0.0), (x0 + w * 0.9, count as f64)],
                color(i)
                    .mix(0.4 + 0.6 * (p + 1) as f64 / pods as f64)
                    .filled(),
            )))?;
        }
        chart.draw_series(std::iter::once(Text::new(
            format!("{:.2}", r.imbalance),
            (i as f64 + 0.3, max_y * 0.97),
            ("sans-serif", 13),
        )))?;
    }
    Ok(())
}

/// Short router label for bar axes.
fn short(name: &str) -> String {
    name.replace("envoy-round-robin", "envoy-rr")
        .replace("envoy-least-request", "envoy-lr")
        .replace("kvroute-prefix-only", "kv-prefix")
        .replace("kvroute-load-only", "kv-load")
        .replace("sglang-cache-aware", "sgl-cache")
        .replace("sglang-round-robin", "sgl-rr")
}
