//! The shape ops' kernels on the host: gathers, scatters and strided copies of host
//! storage (values move, nothing rounds).

use super::kernels::Kernels;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::for_each_offset;
use crate::tensor::{numel, Storage, Tensor};
use std::sync::Arc;

/// A new storage of the same kind holding `src[idx[i]]` at position `i` (host storage;
/// `op` names the op in the error for device storage).
pub(crate) fn gather(src: &Storage, idx: &[usize], op: &str) -> Result<Storage> {
    fn pick<T: Copy>(v: &[T], idx: &[usize]) -> Arc<Vec<T>> {
        Arc::new(idx.iter().map(|&i| v[i]).collect())
    }
    Ok(match src {
        Storage::F32(v) => Storage::F32(pick(v, idx)),
        Storage::F64(v) => Storage::F64(pick(v, idx)),
        Storage::I64(v) => Storage::I64(pick(v, idx)),
        Storage::Cuda(_) => return Err(crate::ops::no_device_kernel(op)),
    })
}

/// A zero storage of `n` elements with each part's element `i` written at `idx[i]`;
/// every part must have the storage kind of the first.
pub(crate) fn scatter(parts: &[(&Storage, &[usize])], n: usize, op: &str) -> Result<Storage> {
    fn put<T: Copy>(out: &mut [T], v: &[T], idx: &[usize]) {
        for (&x, &i) in v.iter().zip(idx) {
            out[i] = x;
        }
    }
    let mixed = || Error::shape(op, "inputs have different storage kinds (int and float)");
    let Some((first, _)) = parts.first() else {
        return Err(Error::shape(op, "nothing to scatter"));
    };
    Ok(match first {
        Storage::F32(_) => {
            let mut out = vec![0f32; n];
            for (s, idx) in parts {
                let Storage::F32(v) = s else {
                    return Err(mixed());
                };
                put(&mut out, v, idx);
            }
            Storage::F32(Arc::new(out))
        }
        Storage::F64(_) => {
            let mut out = vec![0f64; n];
            for (s, idx) in parts {
                let Storage::F64(v) = s else {
                    return Err(mixed());
                };
                put(&mut out, v, idx);
            }
            Storage::F64(Arc::new(out))
        }
        Storage::I64(_) => {
            let mut out = vec![0i64; n];
            for (s, idx) in parts {
                let Storage::I64(v) = s else {
                    return Err(mixed());
                };
                put(&mut out, v, idx);
            }
            Storage::I64(Arc::new(out))
        }
        Storage::Cuda(_) => return Err(crate::ops::no_device_kernel(op)),
    })
}

/// A new host storage holding, in row-major order over `shape`, the elements of `src` laid
/// out with `strides` from `base` (a permuted or sliced copy without an index list). Large
/// copies run over rayon's threads, one slab of the first dim each.
pub(super) fn gather_strided(
    src: &Storage,
    shape: &[usize],
    strides: &[usize],
    base: usize,
    op: &str,
) -> Result<Storage> {
    fn copy<T: Copy + Default + Send + Sync>(
        v: &[T],
        shape: &[usize],
        strides: &[usize],
        base: usize,
    ) -> Arc<Vec<T>> {
        use rayon::prelude::*;
        let n = numel(shape);
        let mut out = vec![T::default(); n];
        let slab = |o: &mut [T], sub: &[usize], st: &[usize], b: usize| {
            if let (Some((&inner, outer)), Some((&1, ost))) = (sub.split_last(), st.split_last()) {
                // Rows contiguous in the source: copied a row at a time.
                if inner > 0 {
                    for (row, dst) in o.chunks_exact_mut(inner).enumerate() {
                        let at = b + row_offset(row, outer, ost);
                        dst.copy_from_slice(&v[at..at + inner]);
                    }
                }
                return;
            }
            // Elements apart in the source: the last two dims copied as tiles, so that
            // both sides stay in cache (a transpose).
            if let [outer @ .., r, c] = sub {
                let ([os @ .., sr, sc], rc) = (st, r * c) else {
                    unreachable!("strides have the shape's rank")
                };
                let mut k = 0;
                for_each_offset(outer, [os], |[i]| {
                    for_tiles(*r, *c, |rr, cc| {
                        o[k + rr * c + cc] = v[b + i + rr * sr + cc * sc]
                    });
                    k += rc;
                });
                return;
            }
            let mut k = 0;
            for_each_offset(sub, [st], |[i]| {
                o[k] = v[b + i];
                k += 1;
            });
        };
        // A 2-D copy with its elements apart is tiled whole rather than split in rows.
        let rows_apart = shape.len() == 2 && strides[1] != 1;
        if n >= crate::ops::PAR_MIN && shape.len() > 1 && shape[0] > 1 && !rows_apart {
            let inner = n / shape[0];
            out.par_chunks_mut(inner)
                .enumerate()
                .for_each(|(i, o)| slab(o, &shape[1..], &strides[1..], base + i * strides[0]));
        } else if n > 0 {
            slab(&mut out, shape, strides, base);
        }
        Arc::new(out)
    }
    Ok(match src {
        Storage::F32(v) => Storage::F32(copy(v, shape, strides, base)),
        Storage::F64(v) => Storage::F64(copy(v, shape, strides, base)),
        Storage::I64(v) => Storage::I64(copy(v, shape, strides, base)),
        Storage::Cuda(_) => return Err(crate::ops::no_device_kernel(op)),
    })
}

/// Calls `f(row, col)` over an `r` × `c` block in square tiles (a transpose's reads or
/// writes then stay within a few cache lines per tile).
#[inline(always)]
fn for_tiles(r: usize, c: usize, mut f: impl FnMut(usize, usize)) {
    const TILE: usize = 16;
    for r0 in (0..r).step_by(TILE) {
        for c0 in (0..c).step_by(TILE) {
            for rr in r0..(r0 + TILE).min(r) {
                for cc in c0..(c0 + TILE).min(c) {
                    f(rr, cc);
                }
            }
        }
    }
}

/// The flat offset of row `row` (row-major over the dims `shape`) laid out with `strides`.
fn row_offset(mut row: usize, shape: &[usize], strides: &[usize]) -> usize {
    let mut off = 0;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        off += (row % d) * s;
        row /= d;
    }
    off
}

/// The gradient of [`gather_strided`]: a zero host storage of `n` elements with `g`'s
/// elements (row-major over `shape`) written where the copy read them.
pub(super) fn scatter_strided(
    g: &Storage,
    n: usize,
    shape: &[usize],
    strides: &[usize],
    base: usize,
    op: &str,
) -> Result<Storage> {
    place_parts(&[(g, shape, base)], n, strides, op)
}

/// A zero host storage of `n` elements with each part's elements (row-major over its shape)
/// written at `base + Σ i·strides`; every part must have the storage kind of the first.
pub(super) fn place_parts(
    parts: &[(&Storage, &[usize], usize)],
    n: usize,
    strides: &[usize],
    op: &str,
) -> Result<Storage> {
    fn fill<T: Copy + Default>(
        data: &[&[T]],
        parts: &[(&Storage, &[usize], usize)],
        n: usize,
        strides: &[usize],
    ) -> Arc<Vec<T>> {
        let mut out = vec![T::default(); n];
        for (g, (_, shape, base)) in data.iter().zip(parts) {
            put_strided(&mut out, g, shape, strides, *base);
        }
        Arc::new(out)
    }
    // Every part's data as the first part's kind, or an error naming the op.
    macro_rules! fill_as {
        ($kind:ident) => {{
            let data = parts
                .iter()
                .map(|(s, _, _)| match s {
                    Storage::$kind(v) => Some(&v[..]),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::shape(op, "inputs have different storage kinds (int and float)")
                })?;
            Storage::$kind(fill(&data, parts, n, strides))
        }};
    }
    let Some((first, _, _)) = parts.first() else {
        return Err(Error::shape(op, "nothing to place"));
    };
    Ok(match first {
        Storage::F32(_) => fill_as!(F32),
        Storage::F64(_) => fill_as!(F64),
        Storage::I64(_) => fill_as!(I64),
        Storage::Cuda(_) => return Err(crate::ops::no_device_kernel(op)),
    })
}

/// Writes `g` (row-major over `shape`) into `out` at `base + Σ i·strides`.
fn put_strided<T: Copy>(out: &mut [T], g: &[T], shape: &[usize], strides: &[usize], base: usize) {
    if let (Some((&inner, outer)), Some((&1, ost))) = (shape.split_last(), strides.split_last()) {
        // Rows contiguous in the destination: written a row at a time.
        if inner > 0 {
            for (row, src) in g[..numel(shape)].chunks_exact(inner).enumerate() {
                let at = base + row_offset(row, outer, ost);
                out[at..at + inner].copy_from_slice(src);
            }
        }
        return;
    }
    if let ([outer @ .., r, c], [os @ .., sr, sc]) = (shape, strides) {
        let (mut k, rc) = (0, r * c);
        for_each_offset(outer, [os], |[i]| {
            for_tiles(*r, *c, |rr, cc| {
                out[base + i + rr * sr + cc * sc] = g[k + rr * c + cc]
            });
            k += rc;
        });
        return;
    }
    let mut k = 0;
    for_each_offset(shape, [strides], |[i]| {
        out[base + i] = g[k];
        k += 1;
    });
}

/// The host's shape kernels.
pub(super) struct Host;

impl Kernels for Host {
    fn gather_strided(
        &self,
        op: &'static str,
        x: &Tensor,
        out_shape: &[usize],
        (src, base): (&[usize], usize),
        dtype: DType,
    ) -> Result<(Tensor, Option<u32>)> {
        let s = gather_strided(x.storage(), out_shape, src, base, op)?;
        Ok((Tensor::from_storage(s, out_shape, dtype)?, None))
    }

    fn scatter_strided(
        &self,
        op: &'static str,
        g: &Tensor,
        (in_shape, out_shape): (&[usize], &[usize]),
        (dst, base): (&[usize], usize),
        _onto: bool,
        dtype: DType,
    ) -> Result<(Tensor, Option<u32>)> {
        let s = scatter_strided(g.storage(), numel(in_shape), out_shape, dst, base, op)?;
        Ok((Tensor::from_storage(s, in_shape, dtype)?, None))
    }

    fn cat(
        &self,
        ins: &[Tensor],
        out_shape: &[usize],
        os: &[usize],
        offs: &[usize],
    ) -> Result<Tensor> {
        // Each input's rows copied into place in the output's layout.
        let parts: Vec<(&Storage, &[usize], usize)> = ins
            .iter()
            .zip(offs)
            .map(|(t, &o)| (t.storage(), t.shape(), o))
            .collect();
        let storage = place_parts(&parts, numel(out_shape), os, "cat")?;
        Tensor::from_storage(storage, out_shape, ins[0].dtype())
    }
}
