"""The join link as a QR code, drawn on the server by segno (pure Python, SVG), so it works offline.

Error correction M (15% of the code may be unreadable: a projector's glare), a quiet zone of
four modules as the standard asks, dark on white at full contrast. The SVG scales to whatever
size the page gives it (no fixed width), so it can fill a projector's side column.
"""

import io

import segno


def svg(url: str) -> str:
    code = segno.make_qr(url, error="m")
    out = io.BytesIO()
    code.save(out, kind="svg", scale=10, border=4, dark="#000", light="#fff", xmldecl=False,
              svgns=True, title="Join link: " + url, omitsize=False)
    return out.getvalue().decode("utf-8")
