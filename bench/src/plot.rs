//! What the plots share: their error, colours and fonts.

use plotters::drawing::DrawingAreaErrorKind;
use plotters::style::RGBColor;

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("nothing to plot: the results hold no {0}")]
    NoData(&'static str),
    #[error("drawing the plot failed: {0}")]
    Draw(String),
}

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for PlotError {
    fn from(error: DrawingAreaErrorKind<E>) -> Self {
        PlotError::Draw(error.to_string())
    }
}

/// The family named in the SVG; the viewer picks the font.
pub const FONT: &str = "sans-serif";

/// One colour per series, told apart in print too.
pub const SERIES_COLORS: [RGBColor; 4] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];

/// The ideal (achieved = target) and reference (driver alone) lines.
pub const REFERENCE_COLOR: RGBColor = RGBColor(0x70, 0x70, 0x70);

/// The overhead plot's bars.
pub const BAR_COLOR: RGBColor = RGBColor(0xe3, 0x7b, 0x1c);

/// `color` as the SVG backend writes it (`#RRGGBB`), for finding a series'
/// elements in a plot.
pub fn svg_color(color: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", color.0, color.1, color.2)
}
