//! The run's report: `report.json` (the checker's numbers, the schedule as it ran, every outboxd
//! exit) and `timeline.png` (faults as bands; rows committed and delivered per second, and the lag,
//! as lines), both under the folder given.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use serde_json::Value;

use super::plan::Kind;
use super::world::Injected;

pub fn write(dir: &Path, json: &Value, timeline: &[(u64, u64, u64)], faults: &[(Kind, f64, f64)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(json).unwrap(),
    )
    .unwrap();
    plot(&dir.join("timeline.png"), timeline, faults);
}

/// For a failed run's message: what the Kafka brokers' own logs (saved under `logs`) say about
/// the events that leave a partition without a leader (a session that timed out, a fencing, an
/// unclean election) and their warnings and errors, the last 40 such lines; empty for other sinks.
pub fn broker_events(logs: &Path) -> String {
    let notable = [
        " WARN ",
        " ERROR ",
        "Fencing broker",
        "fenced",
        "UNCLEAN",
        "leader: -1",
    ];
    let mut lines = Vec::new();
    for n in 0.. {
        let Ok(log) = std::fs::read_to_string(logs.join(format!("broker-{n}.log"))) else {
            break;
        };
        lines.extend(
            log.lines()
                .filter(|l| notable.iter().any(|m| l.contains(m)))
                .map(|l| format!("broker-{n}: {}", l.chars().take(300).collect::<String>())),
        );
    }
    if lines.is_empty() {
        return String::new();
    }
    let tail = &lines[lines.len().saturating_sub(40)..];
    format!(
        "--- the brokers' logs: leadership events, warnings, errors ---\n{}",
        tail.join("\n")
    )
}

/// (kind, start s, end s) of each fault, relative to the run's start.
pub fn bands(faults: &[Injected], started: std::time::Instant) -> Vec<(Kind, f64, f64)> {
    faults
        .iter()
        .map(|f| {
            (
                f.kind,
                (f.started - started).as_secs_f64(),
                (f.ended - started).as_secs_f64(),
            )
        })
        .collect()
}

fn colour(kind: Kind) -> RGBColor {
    match kind {
        Kind::Kill9 => RGBColor(230, 60, 60),
        Kind::LeaderKill => RGBColor(160, 0, 0),
        Kind::Pause => RGBColor(240, 150, 40),
        Kind::BrokerKill => RGBColor(120, 60, 200),
        Kind::BrokerFreeze => RGBColor(180, 130, 230),
        Kind::DbRestart => RGBColor(40, 150, 60),
        Kind::ReplicaFailover => RGBColor(120, 200, 110),
        Kind::Partition => RGBColor(30, 90, 200),
        Kind::Loss => RGBColor(90, 170, 230),
        Kind::Slow => RGBColor(150, 210, 240),
        Kind::DiskFull => RGBColor(120, 120, 120),
        Kind::Rewind => RGBColor(200, 170, 40),
    }
}

fn register_font() {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        // plotters draws text with a font it is given; scripts/install-test-deps.sh installs DejaVu.
        let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
            .expect("DejaVu Sans (apt-get install fonts-dejavu-core) to label the timeline");
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(font.into_boxed_slice()),
        )
        .map_err(|_| "font")
        .unwrap();
    });
}

fn plot(path: &Path, timeline: &[(u64, u64, u64)], faults: &[(Kind, f64, f64)]) {
    register_font();
    let root = BitMapBackend::new(path, (1400, 700)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let (upper, lower) = root.split_vertically(400);
    let seconds = timeline.len().max(1) as f64;
    let rate_top = timeline
        .iter()
        .map(|(c, d, _)| (*c).max(*d))
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.1;
    let lag_top = timeline.iter().map(|t| t.2).max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut rates = ChartBuilder::on(&upper)
        .caption(
            "outboxd under a fault schedule: rows per second",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds, 0f64..rate_top)
        .unwrap();
    rates
        .configure_mesh()
        .y_desc("rows/s")
        .label_style(("sans-serif", 13))
        .draw()
        .unwrap();
    let mut lag = ChartBuilder::on(&lower)
        .caption("lag: rows committed, not yet delivered", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds, 0f64..lag_top)
        .unwrap();
    lag.configure_mesh()
        .x_desc("seconds since the load started")
        .y_desc("rows")
        .label_style(("sans-serif", 13))
        .draw()
        .unwrap();
    let mut legend_done = std::collections::HashSet::new();
    for (kind, from, to) in faults {
        let style = colour(*kind).mix(0.25).filled();
        lag.draw_series(std::iter::once(Rectangle::new(
            [(*from, 0.0), (to.max(from + 0.3), lag_top)],
            style,
        )))
        .unwrap();
        let series = rates
            .draw_series(std::iter::once(Rectangle::new(
                [(*from, 0.0), (to.max(from + 0.3), rate_top)],
                style,
            )))
            .unwrap();
        if legend_done.insert(*kind) {
            let c = colour(*kind);
            series.label(kind.name()).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.mix(0.5).filled())
            });
        }
    }
    let line = |pick: fn(&(u64, u64, u64)) -> u64| -> Vec<(f64, f64)> {
        timeline
            .iter()
            .enumerate()
            .map(|(s, t)| (s as f64, pick(t) as f64))
            .collect()
    };
    rates
        .draw_series(LineSeries::new(line(|t| t.0), BLACK.stroke_width(1)))
        .unwrap()
        .label("committed")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(2)));
    rates
        .draw_series(LineSeries::new(line(|t| t.1), BLUE.stroke_width(1)))
        .unwrap()
        .label("delivered (first copy)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLUE.stroke_width(2)));
    lag.draw_series(LineSeries::new(line(|t| t.2), RED.stroke_width(2)))
        .unwrap();
    rates
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .unwrap();
    root.present().unwrap();
}
