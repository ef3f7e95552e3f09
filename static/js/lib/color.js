// Colours that stay readable: the text colour for a shaded background chosen by its luminance, so
// that text on it keeps WCAG's 4.5:1 contrast (https://www.w3.org/TR/WCAG21/#dfn-contrast-ratio).

const DARK = [29, 31, 35];      // the page's text colour, #1d1f23
const LIGHT = [255, 255, 255];

// sRGB channel 0-255 -> linear light.
function linear(c) {
  const s = c / 255;
  return s <= 0.04045 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
}

export function luminance([r, g, b]) {
  return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
}

export function contrast(a, b) {
  const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
  return (hi + 0.05) / (lo + 0.05);
}

// rgb drawn at opacity alpha over a background (white unless given): the colour the eye sees.
export function blend(rgb, alpha, under = LIGHT) {
  return rgb.map((c, i) => Math.round(alpha * c + (1 - alpha) * under[i]));
}

// The text colour (CSS) for this background: the page's dark text when it reaches 4.5:1, else
// white, else black. Between dark and light backgrounds neither the page's text nor white may reach
// 4.5:1, but one of white and black always does: the better of the two has at least √21 ≈ 4.58:1.
export function textOn(background) {
  for (const [rgb, css] of [[DARK, "#1d1f23"], [LIGHT, "#fff"], [[0, 0, 0], "#000"]]) {
    if (contrast(background, rgb) >= 4.5) return css;
  }
  return "#000";
}
