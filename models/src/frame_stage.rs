//! What the two GPU entry stages share, `classify_preset` and `yolo_letterbox`: a contiguous
//! frame in, an image of the same element type out, and one grid-stride kernel over the output
//! pixels that reads two tap tables (rows, columns) of the frame.

use kiln::plugin::{Arg, Attrs, BuildCtx, CustomCall, KArg, KernelLayer, Layer, Op, ValueId};
use kiln::{LowerKind, NodeId, Result};

/// The node's frame and output, checked: the frame is contiguous and both share an element type.
pub(crate) struct FrameStage<'a> {
    pub attrs: &'a Attrs,
    pub frame: ValueId,
    pub out: ValueId,
    /// The frame's dims with a batch of 1 in front, as the shape rules take them.
    pub per_image: Vec<usize>,
    /// The output's element strides (channel, row, column) within an image.
    pub out_strides: [usize; 3],
}

pub(crate) fn frame_stage<'a>(ctx: &BuildCtx<'a>, node: NodeId, op: &str) -> Result<FrameStage<'a>> {
    let Op::Custom(CustomCall { attrs, .. }) = &ctx.node(node).op else {
        return Err(ctx.err(node, LowerKind::Unsupported, format!("is not {op}")));
    };
    let (frame, out) = (ctx.input(node, 0)?, ctx.output(node)?);
    let d = ctx.value(frame).clone();
    if d.layout.order() != [0, 1] {
        return Err(ctx.err(node, LowerKind::Unsupported, format!("the frame must be contiguous, got {:?}", d.layout)));
    }
    let o = ctx.value(out).clone();
    if o.elem != d.elem {
        let reason = format!("frame and output must share an element type, got {:?} and {:?}", d.elem, o.elem);
        return Err(ctx.err(node, LowerKind::Unsupported, reason));
    }
    let s = o.layout.strides(&o.dims);
    Ok(FrameStage { attrs, frame, out, per_image: [&[1][..], &d.dims].concat(), out_strides: [s[0], s[1], s[2]] })
}

impl FrameStage<'_> {
    /// The kernel `<file stem>_<elem>` of `source` (file name, text) over `pixels` output pixels an
    /// image, with the arguments `(frame, rows, cols, batch, dims..., out)`; `dims` are the stage's own.
    pub fn layer(
        &self,
        ctx: &mut BuildCtx,
        source: (&str, &str),
        taps: [&[f32]; 2],
        dims: Vec<KArg>,
        pixels: usize,
        kind: String,
    ) -> Result<Box<dyn Layer>> {
        let (rows, cols) = (ctx.upload_f32(taps[0])?, ctx.upload_f32(taps[1])?);
        ctx.kernels.add_source(source.0, source.1)?;
        let stem = source.0.trim_end_matches(".cu");
        let entry = format!("{stem}_{}", ctx.value(self.frame).elem.suffix());
        let mut args = vec![Arg::Value(self.frame), Arg::buf(rows), Arg::buf(cols), Arg::Batch];
        args.extend(dims.into_iter().map(Arg::Const));
        args.push(Arg::Value(self.out));
        Ok(Box::new(KernelLayer::new(ctx, &entry, args, pixels)?.kind(kind)))
    }

    /// The output strides as the kernels take them (i64).
    pub fn strides(&self) -> [KArg; 3] {
        self.out_strides.map(|s| KArg::I64(s as i64))
    }
}
