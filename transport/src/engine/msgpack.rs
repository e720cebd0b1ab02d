//! A pull reader over a msgpack byte slice: one [`Item`] per call, containers as their lengths,
//! strings and byte strings borrowed from the input. `rmp` names the markers; lengths and
//! numbers are read here, each bounded by the bytes left, so no input can make it allocate,
//! recurse or read out of bounds.

use rmp::Marker;

use super::error::MsgpackError;

/// One msgpack value's head: a scalar, or the length of a container whose items follow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Item<'a> {
    Nil,
    Bool(bool),
    /// Every non-negative integer, whatever its marker.
    Uint(u64),
    /// Negative integers only.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    /// An extension value (skipped whole).
    Ext,
}

impl Item<'_> {
    /// The kind of value, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Item::Nil => "nil",
            Item::Bool(_) => "a bool",
            Item::Uint(_) => "an unsigned integer",
            Item::Int(_) => "a negative integer",
            Item::Float(_) => "a float",
            Item::Str(_) => "a string",
            Item::Bin(_) => "bytes",
            Item::Array(_) => "an array",
            Item::Map(_) => "a map",
            Item::Ext => "an extension value",
        }
    }
}

/// A cursor over msgpack bytes.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes read so far.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// A capacity for `n` items about to be read: each takes at least one byte, so never more
    /// than the bytes left (a forged length cannot make a caller allocate).
    pub(crate) fn capacity_for(&self, n: u32) -> usize {
        (n as usize).min(self.remaining())
    }

    /// The bytes from `start` to the cursor.
    pub(crate) fn since(&self, start: usize) -> &'a [u8] {
        self.buf.get(start..self.pos).unwrap_or_default()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or(MsgpackError::Truncated { at: self.buf.len() })?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut out = [0_u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, MsgpackError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, MsgpackError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, MsgpackError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn signed(value: i64) -> Item<'a> {
        match u64::try_from(value) {
            Ok(v) => Item::Uint(v),
            Err(_) => Item::Int(value),
        }
    }

    /// Reads the next value's head (a container's items are read by later calls).
    pub(crate) fn read(&mut self) -> Result<Item<'a>, MsgpackError> {
        let at = self.pos;
        let item = match Marker::from_u8(self.u8()?) {
            Marker::FixPos(v) => Item::Uint(v.into()),
            Marker::FixNeg(v) => Item::Int(v.into()),
            Marker::Null => Item::Nil,
            Marker::True => Item::Bool(true),
            Marker::False => Item::Bool(false),
            Marker::U8 => Item::Uint(self.u8()?.into()),
            Marker::U16 => Item::Uint(self.u16()?.into()),
            Marker::U32 => Item::Uint(self.u32()?.into()),
            Marker::U64 => Item::Uint(u64::from_be_bytes(self.array()?)),
            Marker::I8 => Self::signed(i8::from_be_bytes(self.array()?).into()),
            Marker::I16 => Self::signed(i16::from_be_bytes(self.array()?).into()),
            Marker::I32 => Self::signed(i32::from_be_bytes(self.array()?).into()),
            Marker::I64 => Self::signed(i64::from_be_bytes(self.array()?)),
            Marker::F32 => Item::Float(f32::from_be_bytes(self.array()?).into()),
            Marker::F64 => Item::Float(f64::from_be_bytes(self.array()?)),
            Marker::FixStr(n) => Item::Str(self.take(n.into())?),
            Marker::Str8 => {
                let n = self.u8()?;
                Item::Str(self.take(n.into())?)
            }
            Marker::Str16 => {
                let n = self.u16()?;
                Item::Str(self.take(n.into())?)
            }
            Marker::Str32 => {
                let n = self.u32()?;
                Item::Str(self.take(n as usize)?)
            }
            Marker::Bin8 => {
                let n = self.u8()?;
                Item::Bin(self.take(n.into())?)
            }
            Marker::Bin16 => {
                let n = self.u16()?;
                Item::Bin(self.take(n.into())?)
            }
            Marker::Bin32 => {
                let n = self.u32()?;
                Item::Bin(self.take(n as usize)?)
            }
            Marker::FixArray(n) => Item::Array(n.into()),
            Marker::Array16 => Item::Array(self.u16()?.into()),
            Marker::Array32 => Item::Array(self.u32()?),
            Marker::FixMap(n) => Item::Map(n.into()),
            Marker::Map16 => Item::Map(self.u16()?.into()),
            Marker::Map32 => Item::Map(self.u32()?),
            // An extension: a type byte, then its data.
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.u8()?;
                self.ext(n.into())?
            }
            Marker::Ext16 => {
                let n = self.u16()?;
                self.ext(n.into())?
            }
            Marker::Ext32 => {
                let n = self.u32()?;
                self.ext(n as usize)?
            }
            Marker::Reserved => return Err(MsgpackError::ReservedMarker { at }),
        };
        Ok(item)
    }

    fn ext(&mut self, len: usize) -> Result<Item<'a>, MsgpackError> {
        self.take(1)?;
        self.take(len)?;
        Ok(Item::Ext)
    }

    /// Skips one whole value, containers and all, without recursion: a count of the values
    /// still to skip grows by a container's length as its head is read.
    pub(crate) fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_rest(1)
    }

    /// Skips `count` whole values.
    pub(crate) fn skip_rest(&mut self, count: u64) -> Result<(), MsgpackError> {
        let mut pending = count;
        while pending > 0 {
            pending -= 1;
            match self.read()? {
                Item::Array(n) => pending += u64::from(n),
                Item::Map(n) => pending += 2 * u64::from(n),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_every_width_and_sign() {
        let bytes = [
            0x05, 0xff, 0xcc, 0xc8, 0xcd, 0x01, 0x00, 0xd0, 0x7f, 0xd3, 0xf2, 0x22, 0x22, 0x22,
            0x22, 0x22, 0x22, 0x22,
        ];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.read().unwrap(), Item::Uint(5));
        assert_eq!(r.read().unwrap(), Item::Int(-1));
        assert_eq!(r.read().unwrap(), Item::Uint(200));
        assert_eq!(r.read().unwrap(), Item::Uint(256));
        assert_eq!(r.read().unwrap(), Item::Uint(127));
        assert_eq!(
            r.read().unwrap(),
            Item::Int(0xf222_2222_2222_2222_u64 as i64)
        );
        assert_eq!(r.remaining(), 0);
        assert_eq!(r.read(), Err(MsgpackError::Truncated { at: bytes.len() }));
    }

    #[test]
    fn skip_passes_nested_containers_and_extensions() {
        // [[1, {"a": [2]}], ext8(len 2), 3]
        let bytes = [
            0x93, 0x92, 0x01, 0x81, 0xa1, b'a', 0x91, 0x02, 0xc7, 0x02, 0x05, 0xaa, 0xbb, 0x03,
        ];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.read().unwrap(), Item::Array(3));
        r.skip().unwrap();
        assert_eq!(r.read().unwrap(), Item::Ext);
        assert_eq!(r.read().unwrap(), Item::Uint(3));
    }

    #[test]
    fn a_forged_length_ends_as_truncated() {
        // array32 of 4 billion items, then nothing.
        let bytes = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x01];
        let mut r = Reader::new(&bytes);
        assert!(matches!(r.skip(), Err(MsgpackError::Truncated { .. })));
        let mut r = Reader::new(&bytes);
        assert_eq!(r.read().unwrap(), Item::Array(u32::MAX));
        assert_eq!(r.capacity_for(u32::MAX), 1);
        // str32 longer than the input
        let mut r = Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(r.read(), Err(MsgpackError::Truncated { .. })));
        let mut r = Reader::new(&[0xc1]);
        assert_eq!(r.read(), Err(MsgpackError::ReservedMarker { at: 0 }));
    }
}
