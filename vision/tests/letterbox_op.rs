//! kiln-vision's CPU letterbox and kiln-models' `yolo_letterbox` op (the engine's entry stage
//! for YOLO, which reads BGR frames unless told RGB) give the same model input for the same
//! photo-like frame, in either channel order.

use kiln::image::ChannelOrder;
use kiln::{ByteTensor, Tracer};
use kiln_models::yolo_letterbox;
use kiln_vision::{frame_bytes, letterbox, RgbImage};

fn op_letterbox(frame: &ByteTensor, input: [usize; 2], order: Option<ChannelOrder>) -> kiln::HostTensor {
    let [_, h, w3] = frame.shape[..] else { panic!("frame shape") };
    let tracer = Tracer::new();
    let x = yolo_letterbox::frame_input(&tracer, "frame", 1, [h, w3 / 3]);
    let y = match order {
        Some(order) => yolo_letterbox::letterbox_with(&x, input, order),
        None => yolo_letterbox::letterbox(&x, input),
    };
    y.expect("letterbox op").mark_output("input");
    let mut out = kiln::run_cpu(&tracer.graph(), &[("frame", frame)]).expect("cpu run");
    out.remove("input").expect("output")
}

#[test]
fn the_library_letterbox_equals_the_op_in_either_channel_order() {
    for (w, h, input) in [(61u32, 37u32, [64, 64]), (40, 90, [48, 32]), (64, 64, [64, 64]), (13, 7, [32, 48])] {
        let img = RgbImage::from_fn(w, h, |x, y| kiln_vision::image::Rgb([(x * 7 + y * 3) as u8, (x * y) as u8, (255 - x * 2) as u8]));
        let (ours, geometry) = letterbox(&img, input).expect("letterbox");
        let op = op_letterbox(&frame_bytes(&img, ChannelOrder::Bgr), input, None);
        assert_eq!(ours, op, "{w}x{h} into {input:?} ({geometry:?})");
        for order in [ChannelOrder::Bgr, ChannelOrder::Rgb] {
            assert_eq!(op_letterbox(&frame_bytes(&img, order), input, Some(order)), ours, "{w}x{h} {order:?}");
        }
        // Fed RGB bytes as BGR (the default), the op swaps red and blue: the mistake
        // `ChannelOrder` exists to prevent.
        assert_ne!(op_letterbox(&frame_bytes(&img, ChannelOrder::Rgb), input, None), ours);
    }
}
