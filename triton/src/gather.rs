//! The arithmetic of a batch's copies, apart from the copies themselves (so it is tested without a
//! GPU): where each request buffer lands in an engine binding, which byte ranges of a binding one
//! staged copy covers, where a request's images of an output lie, and how the page-locked staging
//! buffer is divided. Every sum and product is checked: sizes come from requests.

use crate::error::{BackendError, Result};
use std::ops::Range;

/// One request buffer's place in a binding: `len` bytes from byte `at` on, taken from buffer
/// `buffer` of member `member` (indices in the order given to [`plan_input`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub member: usize,
    pub buffer: usize,
    pub at: usize,
    pub len: usize,
}

/// What [`plan_input`] needs to know of one request: the image its part of the batch starts at,
/// its batch, and the lengths of its buffers for this input, in order.
pub struct Part<'a> {
    pub offset: usize,
    pub batch: usize,
    pub buffers: &'a [usize],
}

/// Places every buffer of every request in a binding of `room` bytes holding `per_image` bytes an
/// image: request images follow each other from their offset on, and a request's buffers follow
/// each other inside its part. A request whose buffers do not hold exactly its images' bytes, or
/// whose part does not fit the binding, is refused (nothing may be copied past the binding).
pub fn plan_input(parts: &[Part], per_image: usize, room: usize) -> Result<Vec<Segment>> {
    let overflow = |what: &str| BackendError::Request { reason: format!("{what} overflows the address space") };
    let mut segments = Vec::with_capacity(parts.iter().map(|p| p.buffers.len()).sum());
    for (member, part) in parts.iter().enumerate() {
        let start = part.offset.checked_mul(per_image).ok_or_else(|| overflow("a request's offset in the batch"))?;
        let need = part.batch.checked_mul(per_image).ok_or_else(|| overflow("a request's size"))?;
        let end = start.checked_add(need).ok_or_else(|| overflow("a request's end in the batch"))?;
        if end > room {
            return Err(BackendError::Request {
                reason: format!(
                    "images {}..{} ({end} bytes) do not fit the engine's binding of {room} bytes",
                    part.offset,
                    part.offset + part.batch
                ),
            });
        }
        let held = part.buffers.iter().try_fold(0usize, |sum, &len| sum.checked_add(len)).ok_or_else(|| overflow("a request's buffers"))?;
        if held != need {
            return Err(BackendError::Request {
                reason: format!("its buffers hold {held} bytes, but {} image(s) of {per_image} bytes need {need}", part.batch),
            });
        }
        let mut at = start;
        for (buffer, &len) in part.buffers.iter().enumerate() {
            if len > 0 {
                segments.push(Segment { member, buffer, at, len });
            }
            at += len; // at most `end`, checked above
        }
    }
    Ok(segments)
}

/// The byte ranges of a binding covered by the segments `pick` selects, adjacent ones merged:
/// one copy each. Requests of a batch are contiguous, so a batch whose requests are all in host
/// memory is one range, hence one host-to-device copy.
pub fn spans(segments: &[Segment], pick: impl Fn(&Segment) -> bool) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for s in segments.iter().filter(|s| pick(s)) {
        match out.last_mut() {
            Some(last) if last.end == s.at => last.end += s.len,
            _ => out.push(s.at..s.at + s.len),
        }
    }
    out
}

/// The bytes of images `offset..offset + count` in a binding holding `total` images of
/// `per_image` bytes; refused past `total`.
pub fn image_range(offset: usize, count: usize, per_image: usize, total: usize) -> Result<Range<usize>> {
    let past = || BackendError::Request { reason: format!("images {offset}..+{count} are past the batch of {total}") };
    let end = offset.checked_add(count).filter(|&e| e <= total).ok_or_else(past)?;
    // `end <= total`, and `total * per_image` bytes exist in the binding, so neither product wraps
    // unless the binding itself could not exist; checked anyway.
    let start = offset.checked_mul(per_image).ok_or_else(past)?;
    let stop = end.checked_mul(per_image).ok_or_else(past)?;
    Ok(start..stop)
}

/// Offsets in the staging buffer start at multiples of 256 bytes (whole DMA lines).
pub const STAGING_ALIGN: usize = 256;

/// Lays regions of `sizes` bytes out one after another, each at a multiple of [`STAGING_ALIGN`]:
/// their offsets and the bytes the whole needs.
pub fn layout(sizes: &[usize]) -> Result<(Vec<usize>, usize)> {
    let overflow = || BackendError::Request { reason: format!("staging regions of {sizes:?} bytes overflow the address space") };
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut at = 0usize;
    for &size in sizes {
        offsets.push(at);
        let padded = size.checked_next_multiple_of(STAGING_ALIGN).ok_or_else(overflow)?;
        at = at.checked_add(padded).ok_or_else(overflow)?;
    }
    Ok((offsets, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_land_one_after_another_from_each_requests_offset() {
        // Request 0: 1 image in one buffer; request 1: 2 images in buffers of 10 and 30 bytes
        // (Triton may split an input); request 2: 1 image, empty buffer skipped.
        let parts = [
            Part { offset: 0, batch: 1, buffers: &[20] },
            Part { offset: 1, batch: 2, buffers: &[10, 30] },
            Part { offset: 3, batch: 1, buffers: &[0, 20] },
        ];
        let s = plan_input(&parts, 20, 100).unwrap();
        let at: Vec<(usize, usize, usize, usize)> = s.iter().map(|s| (s.member, s.buffer, s.at, s.len)).collect();
        assert_eq!(at, vec![(0, 0, 0, 20), (1, 0, 20, 10), (1, 1, 30, 30), (2, 1, 60, 20)]);
        assert_eq!(spans(&s, |_| true), vec![0..80]);
        // Host buffers of members 0 and 2 only: two copies, request 1 (on a GPU) between them.
        assert_eq!(spans(&s, |s| s.member != 1), vec![0..20, 60..80]);
        assert_eq!(spans(&s, |_| false), Vec::<Range<usize>>::new());
    }

    #[test]
    fn a_request_that_does_not_fill_or_fit_its_part_is_refused() {
        let short = plan_input(&[Part { offset: 0, batch: 2, buffers: &[20, 10] }], 20, 100).unwrap_err().to_string();
        assert!(short.contains("its buffers hold 30 bytes, but 2 image(s) of 20 bytes need 40"), "{short}");
        let past = plan_input(&[Part { offset: 4, batch: 2, buffers: &[40] }], 20, 100).unwrap_err().to_string();
        assert!(past.contains("images 4..6 (120 bytes) do not fit the engine's binding of 100 bytes"), "{past}");
        let huge = plan_input(&[Part { offset: usize::MAX / 2, batch: 1, buffers: &[20] }], 20, 100).unwrap_err().to_string();
        assert!(huge.contains("overflows the address space"), "{huge}");
        let wraps = plan_input(&[Part { offset: 0, batch: 1, buffers: &[usize::MAX, 21] }], 20, 100).unwrap_err().to_string();
        assert!(wraps.contains("a request's buffers overflows"), "{wraps}");
    }

    #[test]
    fn output_slices_and_staging_regions_are_checked() {
        assert_eq!(image_range(1, 2, 4000, 3).unwrap(), 4000..12000);
        assert_eq!(image_range(0, 256, 4000, 256).unwrap(), 0..1_024_000);
        assert!(image_range(2, 2, 4000, 3).unwrap_err().to_string().contains("images 2..+2 are past the batch of 3"));
        assert!(image_range(usize::MAX, 2, 1, usize::MAX).is_err());
        assert!(image_range(1, 1, usize::MAX, 4).is_err());
        assert_eq!(layout(&[602_112 * 3, 12_000, 0, 1]).unwrap(), (vec![0, 1_806_336, 1_818_368, 1_818_368], 1_818_624));
        assert_eq!(layout(&[]).unwrap(), (vec![], 0));
        assert!(layout(&[usize::MAX - 10]).is_err());
        assert!(layout(&[usize::MAX / 2 + 1, usize::MAX / 2 + 1]).is_err());
    }
}
